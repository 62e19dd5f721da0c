"""Bad input to the API and the command lines: one line naming the option and what is wrong (a
FlashError from the API, `error: ...` and a non-zero exit from a CLI), never another exception."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import mlx_flash
from fuzz_helpers import templated_store
from progress_lines import without_progress
from mlx_flash.budget import parse_budget
from mlx_flash.cli.chat import main as chat_main
from mlx_flash.errors import ConfigError, FlashError, MemoryBudgetError
from mlx_flash.units import fmt_apart


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return templated_store(tmp_path_factory.mktemp("bad-inputs"))


@pytest.fixture(scope="module")
def engine(store):
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        yield e


def one_line_error(text: str) -> str:
    """The single `error: ...` line a command printed (and nothing like a traceback)."""
    lines = [ln for ln in without_progress(text) if "Warning" not in ln and "warn(" not in ln]
    assert "Traceback" not in text, text
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    return lines[0]


# ---- 1. odd sampling values: the chat's flags, and the API's keywords -----------------------------
@pytest.mark.parametrize(
    "argv,name",
    [
        (["--temp", "nan"], "--temp"),
        (["--temp", "inf"], "--temp"),
        (["--temp", "-1"], "--temp"),
        (["--seed", "-1"], "--seed"),
        (["--top-p", "2"], "--top-p"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "nan"], "--top-p"),
        (["--top-k", "-1"], "--top-k"),
        (["--max-tokens", "-5"], "--max-tokens"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--speculative", "-2"], "--speculative"),
        (["--speculative", "2", "--temp", "0.5"], "--speculative"),
    ],
)
def test_chat_refuses_odd_sampling_flags_in_one_line(argv, name, capsys):
    # Refused before any model loads: the default model is never looked for.
    assert chat_main(argv + ["--model", "/nonexistent/model"]) == 2
    assert one_line_error(capsys.readouterr().err).startswith(f"error: {name} ")


@pytest.mark.parametrize("argv", [["--temp", "nan"], ["--seed", "-1"]])
def test_chat_command_refuses_odd_values_without_a_traceback(argv):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_flash.chat", *argv],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert r.returncode == 2
    one_line_error(r.stderr)


@pytest.mark.parametrize(
    "argv,name",
    [
        (["--temp", "nan"], "--temp"),
        (["--seed", "-1"], "--seed"),
        (["--top-k", "-1"], "--top-k"),
        (["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_batch_refuses_odd_sampling_flags_in_one_line(argv, name, tmp_path, capsys):
    from mlx_flash.batch import main as batch_main

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "w1"}\n')
    assert batch_main([str(src), str(tmp_path / "out.jsonl"), "--model", "/nonexistent/model"] + argv) == 2
    assert one_line_error(capsys.readouterr().err).startswith(f"error: {name} ")


@pytest.mark.parametrize(
    "argv,name",
    [
        (["--port", "70000"], "--port"),
        (["--queue-limit", "0"], "--queue-limit"),
        (["--max-tokens", "-1"], "--max-tokens"),
        (["--kv-budget", "0.5"], "--kv-budget"),
        (["--kv-budget", "lots"], "--kv-budget"),
    ],
)
def test_serve_refuses_odd_flags_in_one_line(argv, name, capsys):
    pytest.importorskip("aiohttp")
    from mlx_flash.serve import main as serve_main

    assert serve_main(argv + ["--model", "/nonexistent/model"]) == 2
    assert one_line_error(capsys.readouterr().err).startswith(f"error: {name} ")


BAD_SAMPLING = [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(top_p=2.0), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(seed=-1, temperature=1.0), "seed"),
    (dict(seed="7"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(max_tokens="5"), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(stop=[5]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop={"a": 1}), "stop"),
    (dict(speculative=-1), "speculative"),
    (dict(speculative="1"), "speculative"),
    (dict(speculative=2, temperature=0.7), "speculative"),
]


@pytest.mark.parametrize("kw,name", BAD_SAMPLING)
def test_generate_refuses_odd_sampling_values_by_name(engine, kw, name):
    with pytest.raises(ConfigError, match=name) as e:
        engine.generate("w1 w2", **{"max_tokens": 2, **kw})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw,name", [k for k in BAD_SAMPLING if k[1] not in ("max_tokens", "speculative")])
def test_generate_batch_refuses_odd_sampling_values_by_name(engine, kw, name):
    with pytest.raises(ConfigError, match=name):
        engine.generate_batch(["w1 w2"], **{"max_tokens": 2, **kw})


def test_generate_batch_refuses_a_policy_that_is_not_one(engine):
    with pytest.raises(ConfigError, match="policy must be a mlx_flash.Policy"):
        engine.generate_batch(["w1"], max_tokens=2, policy={"gpu_batch": 1})


@pytest.mark.parametrize("kw,name", BAD_SAMPLING)
def test_service_call_refuses_odd_sampling_values_by_name(engine, kw, name, tmp_path):
    with mlx_flash.Service(engine, directory=str(tmp_path / "svc")) as svc:
        ctx = svc.new_context()
        with pytest.raises(ConfigError, match=name):
            list(svc.call(ctx, "w1 w2", **{"max_tokens": 2, **kw}))
        assert "".join(s.text for s in svc.call(ctx, "w1 w2", max_tokens=2)) is not None  # the context goes on


def test_a_tiny_temperature_samples_greedily(engine):
    """1e-320 divides the logits into infinities; its limit is the greedy pick, not a NaN error."""
    assert engine.generate("w1 w2", max_tokens=3, temperature=1e-320, seed=0) == engine.generate("w1 w2", max_tokens=3)


# ---- 2. the cache directory -----------------------------------------------------------------------
def test_a_cache_dir_that_is_a_file_is_named(store, tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    for path, what in ((f, "is not a directory"), (f / "under", "cannot be made")):
        with pytest.raises(ConfigError, match=f"cache_dir '{path}' {what}"):
            mlx_flash.load(store, backend="torch", ffn="stream", cache_dir=str(path), progress=False)
        assert chat_main(["--model", store, "--backend", "torch", "--cache-dir", str(path), "--prompt", "w1"]) == 2
        assert str(path) in one_line_error(capsys.readouterr().err)


def test_a_cache_dir_that_is_a_broken_link_is_named(tmp_path):
    os.symlink(tmp_path / "gone", tmp_path / "link")
    with pytest.raises(ConfigError, match="is not a directory"):
        mlx_flash.EngineConfig(cache_dir=str(tmp_path / "link"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the mode bits say")
def test_an_unwritable_cache_dir_is_named(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="is not writable"):
            mlx_flash.EngineConfig(cache_dir=str(d / "cache"))
    finally:
        d.chmod(0o700)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever the mode bits say (chmod 000 is no test)")
def test_an_unreadable_store_file_is_named(store, tmp_path):
    import shutil

    copy = shutil.copytree(store, tmp_path / "store")
    victim = max((p for p in copy.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    victim.chmod(0)
    try:
        with pytest.raises(FlashError, match=victim.name):
            mlx_flash.load(str(copy), backend="torch", progress=False)
    finally:
        victim.chmod(0o600)


# ---- 3. prompts and wrong-typed keywords of the API ---------------------------------------------
@pytest.mark.parametrize(
    "prompt,message",
    [
        ([{"role": "user", "content": None}], "message 0: 'content' must be a string"),
        ([{"role": "user", "content": 5}], "message 0: 'content' must be a string"),
        ([{"role": 1, "content": "w1"}], "message 0: 'role' must be a string"),
        ([], "non-empty list"),
        ([{"content": "w1"}], "message 0 has no 'role'"),
        ([{"role": "user", "content": "w1"}, "w2"], "non-empty list"),
        (None, "prompt must be"),
        (5, "prompt must be"),
        (b"w1", "prompt must be"),
        ([1, 2], "prompt must be"),
        ({"role": "user", "content": "w1"}, "prompt must be"),
        ("w1 \ud800", "not valid Unicode"),
        ([{"role": "user", "content": "\udcff"}], "message 0 'content' is not valid"),
        ("", "zero tokens"),
    ],
)
def test_bad_prompts_are_named(engine, prompt, message):
    with pytest.raises(ConfigError, match=message):
        engine.generate(prompt, max_tokens=2)
    with pytest.raises(ConfigError, match=message):
        list(engine.stream_generate(prompt, max_tokens=2))


def test_service_call_names_a_prompt_that_is_not_unicode(engine, tmp_path):
    with mlx_flash.Service(engine, directory=str(tmp_path / "svc")) as svc:
        with pytest.raises(ConfigError, match="not valid Unicode"):
            list(svc.call(svc.new_context(), "w1 \ud800", max_tokens=2))


def test_messages_through_the_template_still_answer(engine):
    assert isinstance(engine.generate([{"role": "user", "content": "w4 w5", "odd key": [1]}], max_tokens=2), str)


def test_a_device_this_machine_lacks_is_named(store):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="device 'cuda'"):
        mlx_flash.load(store, backend="torch", device="cuda", progress=False)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(backend="torch", device="tpu"), "device 'tpu' is unknown for backend torch"),
        (dict(backend="mlx", device="cuda"), "device 'cuda' is unknown for backend mlx"),
        (dict(backend="torch", device=5), "device must be a string or None"),
    ],
)
def test_unknown_devices_are_named(store, kw, message):
    with pytest.raises(ConfigError, match=message):
        mlx_flash.load(store, progress=False, **kw)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: mlx_flash.FlashOptions(window="3"), "window must be an integer"),
        (lambda: mlx_flash.FlashOptions(window=3.0), "window must be an integer"),
        (lambda: mlx_flash.FlashOptions(recall="0.9"), "predictor_recall must be a number or None"),
        (lambda: mlx_flash.FlashOptions(statistical_active="0.5"), "statistical_active must be a number"),
        (lambda: mlx_flash.FlashOptions(down_only="yes"), "down_only must be True or False"),
        (lambda: mlx_flash.FlashOptions(mode=3), "sparse_mode 3 is unknown"),
        (lambda: mlx_flash.ExpertOptions(preload="2"), "expert_preload must be an integer"),
        (lambda: mlx_flash.IOOptions(threads="4"), "io_threads must be an integer or None"),
        (lambda: mlx_flash.IOOptions(threads=100_000), "io threads must be in 1-256"),
        (lambda: mlx_flash.EngineConfig(threads=100_000), "threads must be in 1-256"),
        (lambda: mlx_flash.EngineConfig(context="3"), "context must be an integer"),
        (lambda: mlx_flash.EngineConfig(threads=True), "threads must be an integer or None"),
        (lambda: mlx_flash.EngineConfig(prefill_chunk="64"), "prefill_chunk must be an integer"),
        (lambda: mlx_flash.EngineConfig(memory_budget=["1GB"]), "memory_budget must be a string or a number"),
        (lambda: mlx_flash.EngineConfig(weights_budget=True), "weights_budget must be a string or a number or None"),
        (lambda: mlx_flash.EngineConfig(cache_dir=5), "cache_dir must be a string"),
        (lambda: mlx_flash.EngineConfig(verify_checksums="no"), "verify must be True or False"),
        (lambda: mlx_flash.EngineConfig(precision=None), "precision must be a string"),
    ],
)
def test_wrong_typed_options_are_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_load_keywords_of_the_wrong_type_are_named(store):
    with pytest.raises(ConfigError, match="window must be an integer"):
        mlx_flash.load(store, backend="torch", ffn="sparse", flash=mlx_flash.FlashOptions(window="3"), progress=False)
    with pytest.raises(ConfigError, match="context must be an integer"):
        mlx_flash.load(store, backend="torch", context="128", progress=False)


def test_numpy_numbers_are_numbers(engine):
    import numpy as np

    assert isinstance(
        engine.generate("w1", max_tokens=np.int64(2), temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int64(1)),
        str,
    )
    assert mlx_flash.FlashOptions(window=np.int64(3)).window == 3


# ---- 4. messages that misled -------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0.5", 0.5, "0", 0])
def test_a_budget_read_as_zero_bytes_says_what_it_was_read_as(value):
    with pytest.raises(ConfigError) as e:
        parse_budget(value, 10**9)
    assert "is 0 bytes" in str(e.value) and "without a unit is bytes" in str(e.value) and "50%" in str(e.value)
    assert "must be positive" not in str(e.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), True])
def test_a_budget_that_is_no_amount_is_named(value):
    with pytest.raises(ConfigError, match="memory budget|memory_budget"):
        mlx_flash.EngineConfig(memory_budget=value) if isinstance(value, bool) else parse_budget(value, 10**9)


def test_the_weights_budget_is_named_as_itself(store):
    with pytest.raises(ConfigError, match="weights budget '0.5' is 0 bytes"):
        mlx_flash.load(store, backend="torch", weights_budget="0.5", progress=False)


@pytest.mark.parametrize(
    "a,b", [(60_000_000, 60_012_345), (60_000_000, 60_000_001), (59_990_000, 60_040_000), (1000, 300_000)]
)
def test_amounts_that_differ_are_written_differently(a, b):
    x, y = fmt_apart(a, b)
    assert x != y and x.endswith(" MB")


def test_the_memory_minimum_message_shows_two_different_numbers():
    """The largest refused limit is a byte below the minimum; its message must not read
    "308.1 MB is below the minimum 308.1 MB" (memory/process_plan.py names the minimum with room
    for the runtime's run-to-run difference, rounded up)."""
    from mlx_flash.memory import ModelShape
    from mlx_flash.memory.limit import MemoryLimit
    from mlx_flash.memory.process_plan import plan_process

    shape = ModelShape.from_config(
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "vocab_size": 96,
        }
    )

    def refusal(n):
        try:
            plan_process(MemoryLimit(n, "given"), 300_000_123, "torch", shape, 256, 300_017)
        except MemoryBudgetError as e:
            return str(e)
        return None

    lo, hi = 1, 10**10  # refused at lo, accepted at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if refusal(mid) else (lo, mid)
    message = refusal(lo)
    import re

    budget, minimum = re.search(r"memory budget (.+?) is below the minimum (.+?) for", message).groups()
    assert budget != minimum, message


def test_a_weights_budget_below_the_minimum_is_refused_in_stream_mode(store):
    """It used to be taken silently with ffn='stream' (only the sparse and expert planners checked it)."""
    with pytest.raises(MemoryBudgetError, match=r"weights budget 1000 \(0.0 MB\) is below the 0.\d MB"):
        mlx_flash.load(store, backend="torch", ffn="stream", weights_budget=1000, progress=False)


@pytest.mark.parametrize(
    "ffn,flash",
    [
        ("auto", None),
        ("resident", None),
        ("stream", None),
        ("sparse", mlx_flash.FlashOptions(mode="hybrid", predictor="dense")),
    ],
)
def test_the_memory_budget_is_honoured_in_every_ffn_mode(store, ffn, flash):
    with pytest.raises(MemoryBudgetError, match="memory budget 1.0 MB is below"):
        mlx_flash.load(store, backend="torch", ffn=ffn, flash=flash, memory_budget="1MB", progress=False)
    from mlx_flash.memory import process_rss

    budget = process_rss() + 10**9  # what this process holds depends on the tests before this one
    with mlx_flash.load(store, backend="torch", ffn=ffn, flash=flash, memory_budget=budget, progress=False) as e:
        assert e.memory_plan["limit"] == budget
