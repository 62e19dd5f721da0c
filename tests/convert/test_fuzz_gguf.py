"""Fuzzing GGUF reading as the trust boundary it is: a GGUF whose header or metadata is truncated or
has bytes flipped, read as a source (`read_source`, then every tensor taken and the tokenizer
built, as conversion does), ends in a `FlashError` subclass or in success: never another exception
type, a signal or a hang.

Two files are fuzzed: a tiny llama GGUF built here (gpt2 vocabulary, Q4_0/Q8_0/F16/F32 tensors),
whose mutations often still read, and the default model's GGUF cut after its metadata and tensor
table (its tensor data is left out, so it never reads fully: what it exercises is the parser on a
real 49k-token vocabulary).

How crashes and hangs are caught: every hypothesis case runs in-process under a SIGALRM timer
(`CASE_SECONDS`), backed by `faulthandler.dump_traceback_later` for a hang in native code (it kills
the run with a traceback). A signal (SIGSEGV, SIGFPE, SIGABRT) cannot be caught in-process, so
`test_sample_in_subprocess` runs a sample of the cases in a child process and fails when the child
dies of a signal, times out or exits non-zero.

Counts: a few hundred cases by default; MLX_FLASH_FUZZ=full runs more than 2000 (with `pytest -s`
each test prints how many cases it ran and how they ended).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
gguf = pytest.importorskip("gguf")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mlx_flash.convert.sources import read_source  # noqa: E402
from fuzz_helpers import report, time_limit  # noqa: E402
from mlx_flash.errors import FlashError  # noqa: E402

FULL = os.environ.get("MLX_FLASH_FUZZ") == "full"
N_TINY = 1000 if FULL else 200
N_META = 800 if FULL else 150
N_DEFAULT = 100 if FULL else 10
N_CHILD = 200 if FULL else 40
PREFIX_LIMIT = 4 << 20  # the default model's header, vocabulary and tensor table (1.8 MB) and some data


ARCH = "llama"


def tiny_metadata() -> dict:
    from mlx_flash.convert.gguf_tokenizer import byte_alphabet

    tokens = sorted(set(byte_alphabet().values())) + ["Ġt", "<|endoftext|>"]
    a = f"{ARCH}."
    return {
        a + "block_count": 1,
        a + "context_length": 256,
        a + "embedding_length": 64,
        a + "feed_forward_length": 128,
        a + "attention.head_count": 4,
        a + "attention.head_count_kv": 2,
        a + "attention.layer_norm_rms_epsilon": 1e-5,
        a + "rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.bos_token_id": len(tokens) - 1,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }


def add_value(w, key: str, value) -> None:
    """Write one metadata value with the GGUF type its Python type suggests."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        if 0 <= value < 1 << 32:
            w.add_uint32(key, value)
        elif -(1 << 31) <= value < 0:
            w.add_int32(key, value)
        elif 0 <= value < 1 << 64:
            w.add_uint64(key, value)
        else:
            w.add_int64(key, max(-(1 << 63), min(value, (1 << 63) - 1)))
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def write_tiny_gguf(path: str, override: tuple | None = None) -> None:
    """A one-layer llama with a byte-level BPE vocabulary, as llama.cpp writes one; `override`:
    (metadata key, new value, or None to leave the key out)."""
    rng = np.random.default_rng(0)
    Q = gguf.GGMLQuantizationType
    d, ff = 64, 128
    meta = tiny_metadata()
    vocab = len(meta["tokenizer.ggml.tokens"])
    if override is not None:
        meta[override[0]] = override[1]
    w = gguf.GGUFWriter(path, ARCH)
    for key, value in meta.items():
        if value is not None:
            add_value(w, key, value)
    tensors = {
        "token_embd.weight": ((vocab, d), Q.F16),
        "output_norm.weight": ((d,), Q.F32),
        "blk.0.attn_norm.weight": ((d,), Q.F32),
        "blk.0.ffn_norm.weight": ((d,), Q.F32),
        "blk.0.attn_q.weight": ((d, d), Q.Q8_0),
        "blk.0.attn_k.weight": ((d // 2, d), Q.Q8_0),
        "blk.0.attn_v.weight": ((d // 2, d), Q.Q4_0),
        "blk.0.attn_output.weight": ((d, d), Q.Q4_0),
        "blk.0.ffn_gate.weight": ((ff, d), Q.Q4_0),
        "blk.0.ffn_up.weight": ((ff, d), Q.Q4_0),
        "blk.0.ffn_down.weight": ((d, ff), Q.Q4_0),
    }
    for name, (shape, qtype) in tensors.items():
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, a)
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def header_end(path: str) -> int:
    """Where the tensor data starts: the header, metadata and tensor table lie before it."""
    return int(gguf.GGUFReader(path).data_offset)


def default_prefix(out: str) -> str | None:
    """The default model's GGUF cut after its tensor table, or None when the model is not installed."""
    from mlx_flash.default_model import default_model_path

    try:
        src = default_model_path()
    except FlashError:
        return None
    if not os.path.isfile(src):
        return None
    with open(src, "rb") as fh:
        head = fh.read(PREFIX_LIMIT)
    with open(out, "wb") as fh:
        fh.write(head)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_gguf")
    tiny = str(root / "tiny.gguf")
    write_tiny_gguf(tiny)
    return {"tiny": tiny, "default": default_prefix(str(root / "default-prefix.gguf"))}


def read_fully(path: str, out_dir: str) -> str:
    """What conversion does with a source: read it, take every tensor, build the tokenizer."""
    src = read_source(path)
    for name in src.tensors.names():
        src.tensors.take_numpy(name)
    src.save_tokenizer(out_dir)
    return "read"


mutations = st.tuples(
    st.sampled_from(["flip", "flip", "flip", "cut", "cut_header"]),
    st.floats(0, 1, exclude_max=True),
    st.integers(1, 255),
    st.integers(1, 8),
    st.floats(0, 1),
)


def run_case(path: str, span: int, case, tally: collections.Counter, what: str) -> None:
    """Mutate a copy of `path` within its first `span` bytes (the header region) and read it."""
    how, where, xor, count, cut_at = case
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-") as tmp, time_limit():
        with open(path, "rb") as fh:
            data = bytearray(fh.read())
        at = int(where * span)
        if how == "flip":
            for i in range(count):
                if at + i < len(data):
                    data[at + i] ^= xor
        elif how == "cut":
            data = data[: int(cut_at * len(data))]
        else:
            data = data[:at]
        mutated = os.path.join(tmp, "m.gguf")
        with open(mutated, "wb") as fh:
            fh.write(bytes(data))
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        try:
            outcome = read_fully(mutated, out)
        except FlashError as e:
            outcome = type(e).__name__
        tally[f"{what} {how}: {outcome}"] += 1


def fuzz(path: str, n: int, what: str) -> collections.Counter:
    tally = collections.Counter()
    span = header_end(path) if what == "tiny" else os.path.getsize(path)

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(mutations)
    def run(case):
        run_case(path, span, case, tally, what)

    run()
    return tally


META_VALUES = [
    0,
    1,
    2,
    3,
    5,
    7,
    63,
    4096,
    2**31 - 1,
    2**32 - 1,
    2**40,
    2**63 - 1,
    -1,
    -(2**31),
    0.0,
    -1.0,
    1e-30,
    1e30,
    float("nan"),
    float("inf"),
    True,
    "",
    "x",
    "12",
    "gpt2",
    "llama",
    "\u00e9",
    None,
    [],
    [0],
    [1, 2, 3],
    ["a"],
    ["Ġ t", "a"],
    ["a b c"],
    [""],
    ["<|endoftext|>"] * 3,
]
meta_cases = st.tuples(
    st.sampled_from(sorted(tiny_metadata())),
    st.one_of(
        st.sampled_from(META_VALUES),
        st.integers(-(2**40), 2**40),
        st.text(max_size=12),
        st.lists(st.integers(0, 300), max_size=5),
        st.lists(st.text(max_size=6), max_size=5),
    ),
)


def run_meta_case(case, tally: collections.Counter) -> None:
    """A tiny GGUF written with one metadata value replaced (any GGUF type) or left out, then read."""
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-") as tmp, time_limit():
        path = os.path.join(tmp, "m.gguf")
        write_tiny_gguf(path, case)
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        try:
            outcome = read_fully(path, out)
        except FlashError as e:
            outcome = type(e).__name__
        tally[f"metadata value: {outcome}"] += 1


def fuzz_meta(n: int) -> collections.Counter:
    tally = collections.Counter()

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(meta_cases)
    def run(case):
        run_meta_case(case, tally)

    run()
    return tally


def test_tiny_gguf_metadata_values():
    t = time.perf_counter()
    tally = fuzz_meta(N_META)
    report("tiny GGUF metadata values replaced", tally, time.perf_counter() - t)
    assert sum(tally.values()) >= N_META // 2
    assert any(k.endswith(": read") for k in tally), "no mutated file read: the harness tests nothing"


def test_tiny_gguf_reads(sources):
    assert read_fully(sources["tiny"], tempfile.mkdtemp()) == "read"  # the unmutated file is a good source


def test_tiny_gguf_mutations(sources):
    t = time.perf_counter()
    tally = fuzz(sources["tiny"], N_TINY, "tiny")
    report("tiny GGUF header flipped / cut", tally, time.perf_counter() - t)
    assert sum(tally.values()) >= N_TINY // 2
    assert any(k.endswith(": read") for k in tally), "no mutated file read: the harness tests nothing"


@pytest.mark.full  # ~13 s for 10 cases; the tiny GGUF's 200 header and 150 metadata cases run by default
def test_default_gguf_header_mutations(sources):
    if sources["default"] is None:
        pytest.skip("the default model package is not installed")
    t = time.perf_counter()
    tally = fuzz(sources["default"], N_DEFAULT, "default")
    report("default model's GGUF header flipped / cut", tally, time.perf_counter() - t)
    assert sum(tally.values()) >= N_DEFAULT // 2


def child_main(tiny: str, n: int) -> None:
    """In a child process: 2n cases of the tiny GGUF (a signal here kills only the child). transformers
    (which imports torch) is imported first where installed: a case whose vocabulary goes to it would
    otherwise spend the import, 10 s of a loaded 2-core machine, inside its own per-case time limit."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    print(f"child ran {sum(fuzz(tiny, n, 'tiny').values()) + sum(fuzz_meta(n).values())} cases")


def test_sample_in_subprocess(sources):
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; import test_fuzz_gguf as t; "
        f"t.child_main({sources['tiny']!r}, {N_CHILD})"
    )
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    print(
        f"\n[fuzz] subprocess sample: {r.stdout.strip().splitlines()[-1:] or ['no output']} "
        f"in {time.perf_counter() - t:.1f} s"
    )
    if r.returncode < 0:
        raise AssertionError(f"child died of signal {signal.Signals(-r.returncode).name}:\n{r.stderr[-3000:]}")
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_block_scale_whose_bias_overflows_is_refused_by_name(sources, tmp_path):
    """A Q4_0 block's bias (-8 x its scale) is kept as float16 beside the scale: a scale past 8188
    (only a corrupt block holds one) is refused naming the tensor, not turned into an infinite bias."""
    path = str(tmp_path / "big-scale.gguf")
    with open(sources["tiny"], "rb") as fh:
        data = bytearray(fh.read())
    t = next(t for t in gguf.GGUFReader(sources["tiny"]).tensors if t.name == "blk.0.attn_v.weight")
    data[t.data_offset : t.data_offset + 2] = np.float16(60000).tobytes()  # the first block's scale
    with open(path, "wb") as fh:
        fh.write(data)
    with pytest.raises(
        FlashError,
        match=r"big-scale\.gguf: tensor model\.layers\.0\.self_attn\.v_proj\.weight: "
        r"a Q4_0 block scale of 60000 puts its bias "
        r"\(-8 x scale\) past float16's range",
    ):
        read_fully(path, str(tmp_path / "out"))
