"""`python -m mlx_flash.batch IN.jsonl OUT.jsonl` (throughput mode's command): result lines, resuming
(ids already in OUT skipped, a last line cut short dropped and re-run), bad input refused in one
`error:` line with exit status 2 and no traceback; and engine.generate_batch's refusals."""

import json
import os
import subprocess
import sys

import pytest

import mlx_flash
from mlx_flash.errors import ConfigError, ContextLengthError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOBS = [
    {"id": "a", "prompt": "The capital of France is"},
    {"id": 2, "messages": [{"role": "user", "content": "Name a large river in Africa."}]},
    {"id": "c", "prompt": "Once upon a time, in a small village,", "max_tokens": 3},
]


def batch(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "mlx_flash.batch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def read_results(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def one_error_line(r, *words):
    """Exit status 2 and a single `error: ...` line on stderr (nothing else), naming `words`."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ---- refused before the model loads --------------------------------------------------------------------

GOOD = {"id": 1, "prompt": "hello"}
RUN = ("--backend", "torch", "--max-tokens", "8", "--threads", "1")


@pytest.mark.parametrize(
    "lines,words",
    [
        ([GOOD, "{not json"], ["line 2", "not JSON"]),
        ([GOOD, "[1, 2]"], ["line 2", 'an object with an "id"']),
        ([{"prompt": "no id"}], ["line 1", '"id"']),
        ([GOOD, {"id": 1, "prompt": "again"}], ["line 2", "id 1 appears twice"]),
        ([{"id": "x", "prompt": "p", "messages": [{"role": "user", "content": "m"}]}], ["line 1", "exactly one of"]),
        ([{"id": "x"}], ["line 1", "exactly one of"]),
        ([GOOD, {"id": 2, "prompt": "p", "max_tokens": "8"}], ["line 2", "max_tokens", "'8'"]),
        ([{"id": 2, "prompt": "p", "max_tokens": 2.5}], ["line 1", "max_tokens", "2.5"]),
        ([{"id": 2, "prompt": "p", "max_tokens": 0}], ["line 1", "max_tokens", ">= 1"]),
        ([{"id": 2, "prompt": "p", "max_tokens": True}], ["line 1", "max_tokens"]),
        ([{"id": 2, "prompt": ["not", "a", "string"]}], ["line 1", '"prompt" must be a string']),
        ([{"id": 2, "messages": []}], ["line 1", '"messages" must be a non-empty list']),
        ([{"id": 2, "messages": [{"role": "user"}]}], ["line 1", '"messages"']),
    ],
    ids=[
        "not-json",
        "not-an-object",
        "missing-id",
        "duplicate-id",
        "prompt-and-messages",
        "neither",
        "max-tokens-string",
        "max-tokens-float",
        "max-tokens-zero",
        "max-tokens-bool",
        "prompt-not-string",
        "messages-empty",
        "message-without-content",
    ],
)
def test_bad_input_lines_are_one_error_line(tmp_path, lines, words):
    src = write_lines(tmp_path / "in.jsonl", lines)
    r = batch(src, tmp_path / "out.jsonl", "--backend", "torch")
    one_error_line(r, str(src), *words)
    assert not (tmp_path / "out.jsonl").exists()  # nothing written for a refused input


@pytest.mark.parametrize(
    "policy,words",
    [
        ("{gpu_batch: 8}", ["policy: not JSON"]),
        ('{"gpu_batch": 8, "batches": 2}', ["policy: unknown field(s) batches"]),
        ('{"gpu_batch": 0}', ["policy: gpu_batch and num_batches must be >= 1"]),
        ('{"order": "sideways"}', ["policy: order must be one of"]),
        ('{"overlap": "no"}', ["policy: overlap must be true or false"]),
    ],
)
def test_a_bad_policy_is_one_error_line(tmp_path, policy, words):
    src = write_lines(tmp_path / "in.jsonl", [GOOD])
    one_error_line(batch(src, tmp_path / "out.jsonl", "--backend", "torch", "--policy", policy), *words)


def test_an_empty_input_is_one_error_line(tmp_path):
    src = tmp_path / "in.jsonl"
    for text in ("", "\n\n"):
        src.write_text(text)
        one_error_line(batch(src, tmp_path / "out.jsonl", "--backend", "torch"), str(src))


def test_a_missing_input_or_a_foreign_output_is_one_error_line(tmp_path):
    one_error_line(batch(tmp_path / "nope.jsonl", tmp_path / "out.jsonl"), "nope.jsonl", "cannot read")
    src = write_lines(tmp_path / "in.jsonl", [GOOD])
    out = write_lines(tmp_path / "out.jsonl", ["some other file"])
    one_error_line(batch(src, out, "--backend", "torch"), str(out), "line 1", "not a result line")
    assert out.read_text() == "some other file\n"  # left as it was


# ---- runs on the default model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(default_gguf):
    with mlx_flash.load(backend="torch", threads=1, progress=False) as e:  # (threads: see test_batch_exactness)
        yield e


@pytest.mark.slow
def test_run_resume_and_a_cut_last_line(tmp_path, engine):
    src = write_lines(tmp_path / "in.jsonl", JOBS)
    out = tmp_path / "out.jsonl"
    r = batch(src, out, *RUN)
    assert r.returncode == 0, r.stderr
    assert "3 prompts in" in r.stderr and "3 to run" in r.stderr
    assert "policy {" in r.stderr and "predicted" in r.stderr and "measured" in r.stderr  # the run's line
    results = read_results(out)
    assert sorted(map(json.dumps, (x["id"] for x in results))) == sorted(json.dumps(j["id"]) for j in JOBS)
    by_id = {json.dumps(x["id"]): x for x in results}
    for job in JOBS:
        x = by_id[json.dumps(job["id"])]
        assert set(x) == {"id", "text", "tokens", "finish_reason"}
        budget = job.get("max_tokens", 8)
        assert isinstance(x["tokens"], int) and 1 <= x["tokens"] <= budget
        assert x["finish_reason"] in ("stop", "length")
        assert x["finish_reason"] == "stop" or x["tokens"] == budget
        # greedy: the text is what the engine generates for that prompt alone
        prompt = job.get("prompt", job.get("messages"))
        assert x["text"] == engine.generate(prompt, max_tokens=budget), job
    first = out.read_text()

    # the same command again: every id is done
    r = batch(src, out, *RUN)
    assert r.returncode == 0, r.stderr
    assert "3 prompts in" in r.stderr and "3 already in" in r.stderr and "0 to run" in r.stderr
    assert out.read_text() == first

    # an interrupted run left its last line cut short: dropped with a warning, that prompt run again
    lines = first.splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    r = batch(src, out, *RUN)
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr and "cut short" in r.stderr
    assert "2 already in" in r.stderr and "1 to run" in r.stderr
    again = read_results(out)
    assert len(again) == 3 and out.read_text().endswith("\n")
    assert sorted(map(json.dumps, again), key=str) == sorted(map(json.dumps, results), key=str)

    # a new line in the input: only it runs
    write_lines(src, JOBS + [{"id": "d", "prompt": "Water boils at", "max_tokens": 2}])
    r = batch(src, out, *RUN)
    assert r.returncode == 0, r.stderr
    assert "4 prompts in" in r.stderr and "1 to run" in r.stderr
    new = read_results(out)
    assert len(new) == 4 and new[-1]["id"] == "d" and new[-1]["tokens"] <= 2
    assert new[-1]["text"] == engine.generate("Water boils at", max_tokens=2)


def test_generate_batch_refuses_an_empty_prompt_list(engine):
    with pytest.raises(ConfigError, match="the prompt list is empty"):
        engine.generate_batch([])


def test_generate_batch_refuses_bad_prompts_and_budgets_naming_the_prompt(engine):
    with pytest.raises(ConfigError, match="list of strings"):
        engine.generate_batch("one string, not a list")
    with pytest.raises(ConfigError, match="2 max_tokens for 3 prompts"):
        engine.generate_batch(["a", "b", "c"], max_tokens=[4, 4])
    with pytest.raises(ConfigError, match=r"prompt 1: max_tokens must be an integer >= 1 \(got 0\)"):
        engine.generate_batch(["a", "b"], max_tokens=[4, 0])
    with pytest.raises(ConfigError, match="prompt 2: each chat message needs 'role' and 'content'"):
        engine.generate_batch(["a", "b", [{"role": "user"}]])


def test_a_prompt_longer_than_the_context_is_refused_naming_it(engine):
    limit = engine.context_limit
    long = "the cat sat on the mat. " * (limit // 4)
    n = len(engine.tokenizer.encode(long))
    assert n >= limit
    with pytest.raises(ContextLengthError) as e:
        engine.generate_batch(["a short one", "and another", long, "after it"], max_tokens=4)
    msg = str(e.value)
    assert msg.startswith(f"prompt 2 has {n} tokens") and str(limit) in msg and "\n" not in msg
