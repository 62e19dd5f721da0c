"""Fuzzing a converted store as the trust boundary it is: a mutated manifest (re-sealed, to reach the
checks behind the seal, or not), or a store file truncated or with bytes flipped, ends in a
`FlashError` subclass or in correct output: never another exception type, a signal or a hang.

How crashes and hangs are caught: every hypothesis case runs in-process under a SIGALRM timer
(`CASE_SECONDS`), so a hang in Python code fails the case; `faulthandler.dump_traceback_later` backs
it up for a hang in native code (it kills the run with a traceback: the suite fails loudly). A
signal (SIGSEGV, SIGFPE, SIGABRT) cannot be caught in-process, so `test_sample_in_subprocess` runs a
sample of the same cases in a child process and fails when the child dies of a signal, times out or
exits non-zero.

Counts: a few hundred cases by default; MLX_FLASH_FUZZ=full runs more than 2000 (with `pytest -s`
each test prints how many cases it ran and how they ended).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tiny_models  # noqa: E402
from fuzz_helpers import report, time_limit  # noqa: E402
from mlx_flash.errors import FlashError, StoreError  # noqa: E402
from mlx_flash.store import open_store  # noqa: E402
from mlx_flash.store.manifest import SEAL  # noqa: E402

FULL = os.environ.get("MLX_FLASH_FUZZ") == "full"
# cases per test: (default, full)
N_MANIFEST = 2400 if FULL else 300
N_BYTES = 600 if FULL else 100
N_CHILD = 200 if FULL else 40
STORE_FILES = ("manifest.json", "resident.safetensors", "ffn_bundles.bin", "tokenizer.json", "tokenizer_config.json")


PRECISIONS = ("source", "q4")  # float32 bundles, and quantized ones (scales and biases fields)


def build_base(root: str) -> list[str]:
    """A tiny random llama converted into stores (as the tiny_store fixture does), built once."""
    from mlx_flash.convert import convert

    hf = os.path.join(root, "llama-hf")
    tiny_models.build("llama", hf)
    return [convert(hf, os.path.join(root, f"llama-{p}"), precision=p, progress=False) for p in PRECISIONS]


@pytest.fixture(scope="module")
def base_stores(tmp_path_factory):
    # tiny_store is per test (tmp_path); the fuzz cases copy one store built once per module.
    # Stamps of verified files go to a cache of this module's, not the user's.
    root = tmp_path_factory.mktemp("fuzz_store")
    old = os.environ.get("MLX_FLASH_CACHE")
    os.environ["MLX_FLASH_CACHE"] = str(root / "cache")
    yield build_base(str(root))
    if old is None:
        os.environ.pop("MLX_FLASH_CACHE", None)
    else:
        os.environ["MLX_FLASH_CACHE"] = old


def read_json(path: str):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


@contextlib.contextmanager
def case_copy(base: str):
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        d = os.path.join(tmp, "store")
        shutil.copytree(base, d)
        yield d, os.path.join(tmp, "cache")


def open_and_generate(d: str, cache: str) -> str:
    """Open, load and generate 2 tokens; returns how it ended ("opened", or the FlashError's class name)."""
    import mlx_flash

    try:
        open_store(d, cache_dir=cache)
    except FlashError as e:
        return type(e).__name__
    try:
        engine = mlx_flash.load(d, backend="torch", progress=False, cache_dir=cache)
        out = engine.generate("w1 w2 w3", max_tokens=2)
    except FlashError as e:
        return "load:" + type(e).__name__
    if not isinstance(out, str):
        raise AssertionError(f"generate returned {type(out).__name__}, not text")
    return "generated"


# ---- 1. manifest mutations ----------------------------------------------------------------------

BAD_NAMES = [
    "../x",
    "/etc/passwd",
    "a/b",
    "",
    "..",
    ".",
    "x" * 300,
    "a\\b",
    "c:x",
    "nul\0l",
    "manifest.json",
    "resident.safetensors",
    "ffn_bundles.bin",
    "tokenizer.json",
]
BAD_VALUES = [
    0,
    -1,
    1,
    2,
    3,
    7,
    2**31,
    2**32,
    2**63,
    -(2**63),
    2**64,
    10**30,
    1e9,
    -1e9,
    0.5,
    1e-300,
    1e308,
    True,
    False,
    None,
    "",
    "x",
    "12",
    [],
    [0],
    [1, 2],
    [[0, 0]],
    {},
    {"a": 1},
    "float32",
    "bfloat16",
]


def paths_of(value, prefix=()):
    """Every path (tuple of keys and indexes) into the parsed manifest, containers included."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            if k != SEAL:
                out += paths_of(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths_of(v, prefix + (i,))
    return out


def get(m, path):
    for k in path:
        m = m[k]
    return m


values = st.one_of(
    st.sampled_from(BAD_VALUES),
    st.sampled_from(BAD_NAMES),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers(-5, 5000), max_size=4),
)
# an edit: (how, which path (an index into paths_of, modulo), new value)
edits = st.tuples(
    st.sampled_from(["set", "set", "set", "delete", "add_key", "rename_file", "scale"]), st.integers(0, 1 << 30), values
)


def apply_edit(m: dict, edit) -> None:
    try:
        _apply_edit(m, edit)
    except (KeyError, TypeError, AttributeError, IndexError):
        pass  # an earlier edit of this case took away what this one edits: the case keeps the others


def _apply_edit(m: dict, edit) -> None:
    how, which, value = edit
    value = copy.deepcopy(value)  # BAD_VALUES' lists are shared: an edit must not put one inside itself
    paths = paths_of(m)
    path = paths[which % len(paths)]
    parent, key = get(m, path[:-1]), path[-1]
    if how == "set":
        parent[key] = value
    elif how == "delete":
        del parent[key]
    elif how == "add_key":
        target = parent[key] if isinstance(parent[key], dict) else parent
        if isinstance(target, dict):
            target[str(value)[:40]] = value
    elif how == "scale" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] = parent[key] * 4096 + 4096
    elif how == "rename_file":  # a file name (a file's own entry, or where a tensor or the FFN lives)
        name = BAD_NAMES[which % len(BAD_NAMES)] if isinstance(value, int) else str(value)[:300]
        spots = [("files", n) for n in m["files"]] + [("tensors", t) for t in m["tensors"]] + [("ffn",)]
        spot = spots[which % len(spots)]
        if spot[0] == "files":
            m["files"][name] = m["files"].pop(spot[1])
        else:
            get(m, spot)["file"] = name


def run_manifest_case(bases: list[str], case, tally: collections.Counter) -> None:
    edit_list, sealed, which = case
    with case_copy(bases[which]) as (d, cache), time_limit():
        path = os.path.join(d, "manifest.json")
        before = read_json(path)
        if sealed:
            tiny_models.edit_manifest(d, lambda m: [apply_edit(m, e) for e in edit_list])
        else:
            m = read_json(path)
            m_body = {k: v for k, v in m.items() if k != SEAL}
            for e in edit_list:
                apply_edit(m_body, e)
            with open(path, "w") as fh:
                json.dump({**m_body, SEAL: m[SEAL]}, fh)
        after = read_json(path)
        outcome = open_and_generate(d, cache)
        if not sealed and after != before and not outcome.startswith("StoreError"):
            raise AssertionError(f"an edit the seal does not cover ended in {outcome}, not StoreError")
        tally[f"{PRECISIONS[which]} {'sealed' if sealed else 'unsealed'} {outcome}"] += 1


manifest_cases = st.tuples(st.lists(edits, min_size=1, max_size=3), st.booleans(), st.integers(0, len(PRECISIONS) - 1))


def fuzz_manifest(bases: list[str], n: int) -> collections.Counter:
    tally = collections.Counter()

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(manifest_cases)
    def run(case):
        run_manifest_case(bases, case, tally)

    run()
    return tally


# ---- 2. truncated or flipped store files --------------------------------------------------------

byte_cases = st.tuples(
    st.sampled_from(STORE_FILES),
    st.sampled_from(["flip", "flip", "cut"]),
    st.floats(0, 1, exclude_max=True),
    st.integers(1, 255),
    st.integers(1, 4),
    st.integers(0, len(PRECISIONS) - 1),
)


def run_bytes_case(bases: list[str], case, tally: collections.Counter) -> None:
    name, how, where, xor, count, which = case
    base = bases[which]
    with case_copy(base) as (d, cache), time_limit():
        path = os.path.join(d, name)
        data = bytearray(read_bytes(path))
        at = int(where * len(data))
        if how == "cut":
            data = data[:at]
        else:
            for i in range(count):  # a short run of flipped bytes
                if at + i < len(data):
                    data[at + i] ^= xor
        with open(path, "wb") as fh:
            fh.write(bytes(data))
        try:
            open_store(d, cache_dir=cache)
        except StoreError:
            tally[f"{name} {how}: StoreError"] += 1
            return
        # only a manifest whose JSON says the same thing opens (a flip in its whitespace, e.g.)
        if name != "manifest.json" or json.loads(bytes(data)) != read_json(os.path.join(base, name)):
            raise AssertionError(f"{name}: {how} at byte {at} was not caught at open")
        tally[f"{name} {how}: same JSON, opened"] += 1


def fuzz_bytes(bases: list[str], n: int) -> collections.Counter:
    tally = collections.Counter()

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(byte_cases)
    def run(case):
        run_bytes_case(bases, case, tally)

    run()
    return tally


def test_manifest_mutations(base_stores):
    t = time.perf_counter()
    tally = fuzz_manifest(base_stores, N_MANIFEST)
    report("store manifest mutations", tally, time.perf_counter() - t)
    assert sum(tally.values()) >= N_MANIFEST // 2
    assert any(k.endswith("generated") for k in tally), "no case reached generation: the harness tests nothing"


def test_truncated_and_flipped_files(base_stores):
    t = time.perf_counter()
    tally = fuzz_bytes(base_stores, N_BYTES)
    report("store bytes flipped / cut", tally, time.perf_counter() - t)
    assert sum(tally.values()) >= N_BYTES // 2


def child_main(bases: list[str], n: int) -> None:
    """In a child process: n manifest and n byte cases (a signal here kills only the child)."""
    a, b = fuzz_manifest(bases, n), fuzz_bytes(bases, n)
    print(f"child ran {sum(a.values()) + sum(b.values())} cases")


def test_sample_in_subprocess(base_stores):
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; import test_fuzz_store as t; "
        f"t.child_main({base_stores!r}, {N_CHILD})"
    )
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MLX_FLASH_CACHE": os.path.join(os.path.dirname(base_stores[0]), "cache")},
    )
    print(
        f"\n[fuzz] subprocess sample: {r.stdout.strip().splitlines()[-1:] or ['no output']} "
        f"in {time.perf_counter() - t:.1f} s"
    )
    if r.returncode < 0:
        raise AssertionError(f"child died of signal {signal.Signals(-r.returncode).name}:\n{r.stderr[-3000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
