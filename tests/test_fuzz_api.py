"""Property-based fuzzing of the public entry points on a tiny random model: random sampling
options, prompts (any unicode, empty strings, huge ints, None, nested lists, dicts with odd keys) and
keyword values to engine.generate / stream_generate / Service.call, and random argv lists to the
chat's main(). Each case must end in normal output or a FlashError (an argparse exit for the CLI),
never another exception, never a hang.

About 300 cases by default; MLX_FLASH_FUZZ=full runs about 2100. `pytest -s` prints the counts."""

from __future__ import annotations

import collections
import contextlib
import io
import os
import sys
import time
from dataclasses import dataclass

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import mlx_flash  # noqa: E402
from fuzz_helpers import templated_store, time_limit  # noqa: E402
from mlx_flash.errors import FlashError  # noqa: E402

FULL = os.environ.get("MLX_FLASH_FUZZ") == "full"
# Examples per test (default, full): about 300 in all by default, about 2100 with MLX_FLASH_FUZZ=full.
COUNTS = {"generate": (80, 600), "stream": (50, 350), "service": (50, 350), "load": (50, 300), "chat": (80, 600)}
CASE_SECONDS = 30  # a case running longer than this is a hang (each one generates a few tokens at most)
RAN = collections.Counter()  # cases run, per test
ENDED = collections.Counter()  # how the calls ended: normal output, a FlashError, an argparse exit


def fuzz_settings(name: str):
    """The test's example count (COUNTS); no deadline (a case may load a model or generate); a fixed
    seed by default, so a failure reproduces, and a random one with MLX_FLASH_FUZZ=full."""
    return settings(
        max_examples=COUNTS[name][1 if FULL else 0],
        deadline=None,
        derandomize=not FULL,
        suppress_health_check=list(HealthCheck),
        database=None,
    )


@pytest.fixture(scope="module", autouse=True)
def report():
    """The counts, printed when the module ends (visible with pytest -s)."""
    t0 = time.perf_counter()
    yield
    print(
        f"\nAPI fuzz: {sum(RAN.values())} cases ({', '.join(f'{k} {v}' for k, v in RAN.items())}) "
        f"in {time.perf_counter() - t0:.1f} s{' (MLX_FLASH_FUZZ=full)' if FULL else ''}; calls ended in: "
        + ", ".join(f"{k} {v}" for k, v in ENDED.items())
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return templated_store(tmp_path_factory.mktemp("fuzz-api"))


@pytest.fixture(scope="module")
def engine(store):
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        yield e


@pytest.fixture(scope="module")
def service(engine, tmp_path_factory):
    with mlx_flash.Service(engine, directory=str(tmp_path_factory.mktemp("fuzz-service"))) as svc:
        yield svc


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A working directory and cache of its own: random --cache-dir / --model values are relative
    paths, and nothing a case writes may land in the checkout."""
    from mlx_flash.cli import chat

    root = tmp_path_factory.mktemp("fuzz-cwd")
    answer = chat.stream_answer
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("MLX_FLASH_CACHE", str(root / "cache"))
        # stream_answer's default `out` is the stdout of import time; the cases' answers go to the
        # stdout each case redirects, where they are checked (and do not flood `pytest -s`).
        mp.setattr(chat, "stream_answer", lambda steps, out=None: answer(steps, out or sys.stdout))
        yield root


# ---- strategies ------------------------------------------------------------------------------------
WORDS = [f"w{i}" for i in range(12)] + ["</s>", "<s>", "<unk>"]
# Surrogates included (undecodable bytes become them), and drawn often: uniform code points rarely are.
any_char = st.one_of(
    st.characters(exclude_categories=()),
    st.sampled_from(["\ud800", "\udcff", "\x00", "\ufeff", "\U0010ffff", "\n", "\u202e"]),
)
words = st.lists(st.sampled_from(WORDS), max_size=6).map(" ".join)
texts = st.one_of(words, st.text(any_char, max_size=20), st.just(""), st.text(max_size=300))
huge_ints = st.integers(min_value=-(2**80), max_value=2**80)
scalars = st.one_of(
    st.none(), st.booleans(), huge_ints, st.floats(), st.text(any_char, max_size=8), st.binary(max_size=4)
)
odd = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(any_char, max_size=5), st.integers()), inner, max_size=3),
    ),
    max_leaves=8,
)
roles = st.one_of(st.sampled_from(["user", "system", "assistant"]), odd)
contents = st.one_of(words, texts, odd)
message = st.fixed_dictionaries(
    {"role": roles, "content": contents}, optional={"name": odd, "": odd, "role ": odd, "tool_calls": odd}
)
messages = st.lists(
    st.one_of(message, st.dictionaries(st.text(any_char, max_size=6), odd, max_size=3), odd), max_size=4
)
prompts = st.one_of(texts, messages, st.lists(messages, max_size=2), odd)


def number(good):
    return st.one_of(good, good, st.floats(), huge_ints, scalars)


sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": number(st.integers(min_value=-2, max_value=4)),
        "temperature": number(st.floats(min_value=0, max_value=3)),
        "top_p": number(st.floats(min_value=0, max_value=1.2)),
        "top_k": number(st.integers(min_value=-1, max_value=200)),
        "seed": number(st.integers(min_value=-1, max_value=2**70)),
        "stop": st.one_of(st.none(), texts, st.lists(st.one_of(texts, odd), max_size=3), odd),
        "speculative": number(st.integers(min_value=-1, max_value=3)),
    },
)


def bounded(kw: dict) -> dict:
    """A fuzzed max_tokens that is a valid count is kept small: the case checks the arguments, a long
    answer would only take time (max_tokens is still given as drawn when it is not a count)."""
    n = kw.get("max_tokens", 256)
    if isinstance(n, int) and not isinstance(n, bool) and n > 4:
        kw = {**kw, "max_tokens": 4}
    return kw if "max_tokens" in kw else {**kw, "max_tokens": 4}


def must_end_well(fn):
    """Run one case: normal output or a one-line FlashError; anything else fails the test."""
    try:
        with time_limit(CASE_SECONDS):
            out = fn()
    except FlashError as e:
        ENDED["FlashError"] += 1
        assert "\n" not in str(e), f"a FlashError of more than one line: {e!r}"
        assert str(e), f"a FlashError without a message: {e!r}"
        return None
    ENDED["output"] += 1
    return out


# ---- the API ---------------------------------------------------------------------------------------
@fuzz_settings("generate")
@given(prompt=prompts, kw=sampling)
def test_generate_ends_in_text_or_a_flash_error(engine, prompt, kw):
    RAN["generate"] += 1
    out = must_end_well(lambda: engine.generate(prompt, **bounded(kw)))
    assert out is None or isinstance(out, str)


@fuzz_settings("stream")
@given(prompt=prompts, kw=sampling)
def test_stream_generate_ends_in_steps_or_a_flash_error(engine, prompt, kw):
    RAN["stream"] += 1
    steps = must_end_well(lambda: list(engine.stream_generate(prompt, **bounded(kw))))
    assert steps is None or all(isinstance(s.text, str) for s in steps)
    if steps:
        assert steps[-1].finish_reason in ("stop", "length")


@fuzz_settings("service")
@given(prompt=prompts, kw=sampling, system=st.one_of(st.none(), texts, odd))
def test_service_call_ends_in_steps_or_a_flash_error(service, prompt, kw, system):
    RAN["service"] += 1
    ctx = must_end_well(lambda: service.new_context(system=system))
    if ctx is None:
        return
    try:
        must_end_well(lambda: list(service.call(ctx, prompt, **bounded(kw))))
        assert not service.get(ctx).pinned  # a failed call leaves the context usable
    finally:
        service.delete(ctx)


@dataclass
class Build:
    """An option group to build inside the case (its constructor's refusal is part of the case)."""

    cls: type
    kw: dict


def options(cls, fields: dict):
    """cls from some drawn fields, or an odd value in its place (a dict, a string...)."""
    return st.one_of(st.none(), st.fixed_dictionaries({}, optional=fields).map(lambda kw: Build(cls, kw)), odd)


def built(kw: dict) -> dict:
    return {k: v.cls(**v.kw) if isinstance(v, Build) else v for k, v in kw.items()}


load_keywords = st.fixed_dictionaries(
    {},
    optional={
        "backend": st.one_of(st.sampled_from(["torch", "mlx", "jax"]), odd),
        "ffn": st.one_of(st.sampled_from(["auto", "resident", "stream", "sparse"]), odd),
        "memory_budget": st.one_of(
            st.sampled_from(["auto", "50%", "600MB", "1MB", "0.5", "-1", "1e9"]),
            number(st.integers(min_value=0, max_value=2 * 10**9)),
        ),
        "weights_budget": st.one_of(st.sampled_from(["50%", "1000", "0.5", "100MB"]), number(st.integers(0, 10**8))),
        "context": number(st.integers(min_value=-1, max_value=300)),
        "precision": st.one_of(st.sampled_from(["auto", "source", "q4", "q5"]), odd),
        "threads": number(st.integers(min_value=-1, max_value=300)),
        "device": st.one_of(st.sampled_from(["cpu", "cuda", "gpu", "cuda:1", ""]), odd),
        "torch_dtype": st.one_of(st.sampled_from(["float32", "bfloat16"]), odd),
        "prefill_chunk": number(st.integers(min_value=-1, max_value=600)),
        "verify_checksums": st.one_of(st.booleans(), odd),
        # relative (the sandbox's), so that no case writes where it should not
        "cache_dir": st.one_of(
            st.sampled_from(["", "cache", "afile", "afile/sub"]),
            st.text(any_char, max_size=6).map(lambda t: "c" + t.replace("..", "")),
            odd,
        ),
        "flash": options(
            mlx_flash.FlashOptions,
            {
                "mode": st.one_of(st.sampled_from(["naive", "hybrid", "predictor", "window", "all"]), odd),
                "window": number(st.integers(min_value=-1, max_value=10**6)),
                "predictor": st.one_of(st.sampled_from(["dense", "gate", "lowrank", "statistical"]), odd),
                "statistical_active": number(st.floats(0, 1)),
                "recall": number(st.floats(0, 1.1)),
                "down_only": st.one_of(st.booleans(), odd),
            },
        ),
        "experts": options(
            mlx_flash.ExpertOptions,
            {
                "policy": st.one_of(st.sampled_from(["edgemoe", "lru", "lfu"]), odd),
                "preload": number(st.integers(min_value=-2, max_value=8)),
            },
        ),
        "io": options(
            mlx_flash.IOOptions,
            {
                "mode": st.one_of(st.sampled_from(["direct", "buffered"]), odd),
                "threads": number(st.integers(min_value=-1, max_value=300)),
            },
        ),
    },
)


@fuzz_settings("load")
@given(kw=load_keywords)
def test_load_ends_in_an_engine_or_a_flash_error(store, sandbox, kw):
    RAN["load"] += 1
    (sandbox / "afile").write_text("not a directory")
    engine = must_end_well(lambda: mlx_flash.load(store, progress=False, **built(kw)))
    if engine is not None:
        with engine:
            assert isinstance(must_end_well(lambda: engine.generate("w1 w2", max_tokens=2)) or "", str)


# ---- the chat's command line -----------------------------------------------------------------------
def flag_values():
    ints = st.one_of(st.integers(min_value=-3, max_value=300).map(str), huge_ints.map(str))
    reals = st.one_of(st.floats(min_value=-1, max_value=3).map(repr), st.sampled_from(["nan", "inf", "-inf", "1e-320"]))
    junk = st.text(any_char, max_size=8)
    budgets = st.sampled_from(["auto", "50%", "0%", "600MB", "1MB", "0.5", "1", "-1", "1e9", "abc", "200%", "2.5GiB"])
    dirs = st.sampled_from(["cache", "cache/sub", "afile", "afile/sub", "", "/proc/version"])

    def c(*v):
        return st.one_of(st.sampled_from(v), junk)

    return {
        "--temp": reals,
        "--top-p": reals,
        "--top-k": ints,
        "--seed": ints,
        "--max-tokens": ints,
        "--speculative": ints,
        "--memory-budget": st.one_of(budgets, junk),
        "--weights-budget": st.one_of(budgets, junk),
        "--context": ints,
        "--prefill-chunk": ints,
        "--threads": ints,
        "--io-threads": ints,
        "--window": ints,
        "--ffn": c("auto", "resident", "stream", "sparse"),
        "--backend": c("torch", "mlx"),
        "--device": c("cpu", "cuda", "gpu", "cuda:3", ""),
        "--torch-dtype": c("float32", "bfloat16"),
        "--precision": c("auto", "source", "q4", "q5"),
        "--io-mode": c("direct", "buffered"),
        "--sparse-mode": c("naive", "hybrid", "predictor", "window", "all"),
        "--predictor": c("dense", "gate", "lowrank", "statistical"),
        "--predictor-recall": reals,
        "--statistical-active": reals,
        "--expert-preload": ints,
        "--cache-dir": st.one_of(dirs, junk),
        "--system": texts,
        "--prompt": texts,
        "--model": st.one_of(st.just("STORE"), junk),
    }


BARE = ["--raw", "--verbose", "--verify", "--down-only", "--help"]


@st.composite
def argvs(draw):
    values = flag_values()
    argv = []
    for _ in range(draw(st.integers(min_value=0, max_value=5))):
        kind = draw(st.integers(min_value=0, max_value=9))
        if kind < 7:
            flag = draw(st.sampled_from(sorted(values)))
            argv += [flag, draw(values[flag])]
        elif kind < 9:
            argv.append(draw(st.sampled_from(BARE)))
        else:
            argv.append(draw(st.text(any_char, max_size=10)))
    return argv


@fuzz_settings("chat")
@given(argv=argvs())
def test_chat_main_ends_in_an_answer_or_one_error_line(store, sandbox, argv):
    from mlx_flash.cli.chat import main

    RAN["chat"] += 1
    (sandbox / "afile").write_text("not a directory")
    # The store and a one-shot prompt come first, so that the drawn flags override them (no REPL on
    # the test's stdin); a small answer keeps a case short.
    argv = ["--model", store, "--backend", "torch", "--prompt", "w1 w2", "--max-tokens", "3"] + [
        store if a == "STORE" else a for a in argv
    ]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), time_limit(CASE_SECONDS):
        try:
            code = main(argv)
            ENDED["FlashError" if code else "output"] += 1
        except SystemExit as e:  # argparse: --help (0) or a malformed flag (2)
            code = e.code
            ENDED["argparse exit"] += 1
    assert code in (0, 1, 2), (argv, code, err.getvalue())
    assert "Traceback" not in out.getvalue() + err.getvalue(), (argv, err.getvalue())
    if code == 2 and "usage:" not in err.getvalue():
        errors = [ln for ln in err.getvalue().splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1, (argv, err.getvalue())
