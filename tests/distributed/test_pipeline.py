"""A model split by layers across ranks of an MLX ring on this machine (loopback): the plan gives every
rank a contiguous range by its memory; greedy tokens and every step's logits of 2 and 3 ranks equal
the single-process run, on both compute backends; a rank that dies mid-generation is named by rank 0,
which exits non-zero; a rank that stalls is named within the timeout."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import mlx_flash
from mlx_flash.distributed.stage_policy import micro_batches_text
from mlx_flash.distributed.stages import plan_stages
from mlx_flash.errors import ConfigError
from greedy import greedy
from greedy_rank import PROMPT, TINY_PROMPT
from ring import start_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 12


def test_stages_follow_each_ranks_room():
    even = plan_stages([10] * 30, [1000, 1000])
    assert [len(s) for s in even] == [15, 15] and even[0].start == 0 and even[-1].stop == 30
    assert [len(s) for s in plan_stages([10] * 30, [1000, 2000])] == [10, 20]
    # rank 0 also holds the embeddings and head: its room for layers is what they leave
    assert [len(s) for s in plan_stages([10] * 30, [1500, 1000], rank0_fixed=500)] == [15, 15]
    three = plan_stages([10] * 7, [1, 1, 100])
    assert [len(s) for s in three] == [1, 1, 5]  # every rank runs at least one layer
    assert [s.start for s in three[1:]] == [s.stop for s in three[:-1]]


def test_impossible_stages_are_refused():
    with pytest.raises(ConfigError, match="at least 3 layers"):
        plan_stages([10, 10], [1, 1, 1])
    with pytest.raises(ConfigError, match="rank 0 has no memory left for layers"):
        plan_stages([10] * 4, [100, 100], rank0_fixed=200)


def single_process(store_dir, backend):
    with mlx_flash.load(store_dir, backend=backend, progress=False) as e:
        return greedy(e, PROMPT, STEPS)


def run_ranks(n, store_dir, backend, tmp_path, launcher="ring", *extra):
    out = str(tmp_path / f"out-{n}-{backend}.npz")
    procs = start_ranks(
        n,
        [os.path.join(HERE, "greedy_rank.py"), store_dir, backend, out, str(STEPS), *extra],
        tmp_path,
        env={"PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])},
        launcher=launcher,
    )
    results = [p.communicate(timeout=300) for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {err[-2000:]}"
    return np.load(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,ranks,launcher",
    [
        ("mlx", 2, "ring"),
        ("mlx", 3, "ring"),
        ("torch", 2, "gloo"),
        # the same stages over the other backend/launcher pairs: ~13 s the default tier leaves here
        pytest.param("torch", 2, "ring", marks=pytest.mark.full),
        pytest.param("torch", 3, "ring", marks=pytest.mark.full),
        pytest.param("mlx", 3, "gloo", marks=pytest.mark.full),
    ],
)
def test_pipelined_greedy_equals_one_process(store_dir, backend, ranks, launcher, tmp_path):
    want_tokens, want_logits = single_process(store_dir, backend)
    got = run_ranks(ranks, store_dir, backend, tmp_path, launcher)
    stages = got["stages"]
    assert len(stages) == ranks and stages[0][0] == 0 and all(b > a for a, b in stages)
    assert got["tokens"].tolist() == want_tokens
    assert np.array_equal(got["logits"], want_logits)


@pytest.mark.slow
def test_a_gemma_pipeline_keeps_each_layers_attention_kind(tiny_store, tmp_path):
    """Gemma 3's sliding and full layers (a per-layer config list, cut with the layers): 2 ranks
    equal one process past the window."""
    store, _ = tiny_store("gemma3_text")
    with mlx_flash.load(store, backend="mlx", progress=False) as e:
        want_tokens, want_logits = greedy(e, TINY_PROMPT, STEPS)
    got = run_ranks(2, store, "mlx", tmp_path, "ring", "tiny")
    assert [list(s) for s in got["stages"]] == [[0, 3], [3, 6]]
    assert got["tokens"].tolist() == want_tokens and np.array_equal(got["logits"], want_logits)


def _chat_ranks(n, store_dir, tmp_path, *extra, launcher="ring"):
    return start_ranks(
        n,
        [
            "-m",
            "mlx_flash.chat",
            "--model",
            store_dir,
            "--pipeline",
            "--prompt",
            "Write a long story about a lighthouse keeper.",
            "--max-tokens",
            "400",
            *extra,
        ],
        tmp_path,
        launcher=launcher,
    )


def _wait_for_text(proc, seconds=120):
    """Block until rank 0 has streamed some of its answer."""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    end, seen = time.time() + seconds, b""
    while time.time() < end and len(seen) < 40:
        try:
            seen += os.read(fd, 4096)
        except BlockingIOError:
            time.sleep(0.05)
    os.set_blocking(fd, True)
    assert len(seen) >= 40, "rank 0 produced no answer"


def _signal_rank_1_mid_answer(procs, sig):
    """Send `sig` to rank 1 once rank 0 has streamed part of its answer: (seconds until rank 0 ended,
    its stderr)."""
    try:
        _wait_for_text(procs[0])
        t = time.time()
        procs[1].send_signal(sig)
        _, err = procs[0].communicate(timeout=60)
        return time.time() - t, err
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="signals to processes of this machine")
@pytest.mark.parametrize("launcher", ["ring", pytest.param("gloo", marks=pytest.mark.full)])  # one launcher by default
def test_a_rank_killed_mid_generation_is_named_and_rank_0_exits_non_zero(store_dir, tmp_path, launcher):
    procs = _chat_ranks(2, store_dir, tmp_path, launcher=launcher)
    took, err = _signal_rank_1_mid_answer(procs, signal.SIGKILL)
    assert procs[0].returncode not in (0, None)
    assert "rank 1" in err and took < 30, (took, err[-500:])
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="signals to processes of this machine")
def test_a_stalled_rank_is_named_within_the_timeout(store_dir, tmp_path):
    procs = _chat_ranks(2, store_dir, tmp_path, "--pipeline-timeout", "5")
    took, err = _signal_rank_1_mid_answer(procs, signal.SIGSTOP)
    assert procs[0].returncode not in (0, None)
    assert "no answer from rank 1 within 5 s" in err and 4 < took < 30, (took, err[-500:])


@pytest.mark.slow
def test_a_rank_with_another_store_is_refused(store_dir, tiny_store, tmp_path):
    """Every rank must hold the same store (the manifests' digests are compared at start): a rank
    given another model is refused in one line on every rank, and no rank hangs."""
    other, _ = tiny_store("llama")

    def argv(r):
        return [
            "-m",
            "mlx_flash.chat",
            "--model",
            store_dir if r == 0 else other,
            "--pipeline",
            "--prompt",
            "Hello",
            "--max-tokens",
            "4",
        ]

    procs = start_ranks(2, argv, tmp_path)
    results = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2, err[-500:]
        assert "rank 1's copy of the store differs from rank 0's" in err and "Traceback" not in err


BATCH = [
    ("Write a haiku about rain.", 12),
    ("List three prime numbers.", 1),
    ("Who wrote Hamlet?", 16),
    ("Name a color of the sky.", 9),
    ("What is the boiling point of water?", 14),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,ranks,launcher,extra",
    [
        pytest.param("torch", 2, "gloo", (), marks=pytest.mark.full),  # the stream case below is torch over gloo too
        ("mlx", 3, "ring", ("--micro-batches", "5")),  # more in flight than ranks (4 live sequences: 4 of 1 row)
        # FFN layers read whole, each rank holding the few its weights' share leaves room for
        ("torch", 2, "gloo", ("--ffn", "stream", "--weights-budget", "70%")),
    ],
)
def test_a_batch_through_the_ranks_equals_one_process(store_dir, engines, backend, ranks, launcher, extra, tmp_path):
    """The throughput mode across ranks (`python -m mlx_flash.batch --pipeline`, micro-batches in
    flight on every rank, as many as the stage policy chooses or --micro-batches says, sequences of
    different lengths leaving as they finish, one after a single token): every answer equals one
    process's generate_batch."""
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": k, "messages": [{"role": "user", "content": p}], "max_tokens": n}) + "\n"
            for k, (p, n) in enumerate(BATCH)
        )
    )
    out = tmp_path / "out.jsonl"
    procs = start_ranks(
        ranks,
        [
            "-m",
            "mlx_flash.batch",
            str(prompts),
            str(out),
            "--model",
            store_dir,
            "--backend",
            backend,
            "--pipeline",
            *extra,
        ],
        tmp_path,
        launcher=launcher,
    )
    results = [p.communicate(timeout=300) for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {err[-2000:]}"
    chosen = re.findall(r"pipeline policy: (\d+) micro-batch(?:es)? of up to (\d+) rows for 4 sequences", results[0][1])
    if "--micro-batches" in extra:
        assert not chosen and f"pipeline batch: {ranks} ranks, 4 micro-batches in flight" in results[0][1]
    else:  # the policy chose from the ranks' measured stages; the run used its choice
        assert len(chosen) == 1, results[0][1][-2000:]
        m, rows = map(int, chosen[0])
        assert rows == -(-4 // m)  # the rows of its largest micro-batch, from the 4 live sequences
        assert f"pipeline batch: {ranks} ranks, {micro_batches_text(m)} in flight" in results[0][1]
    if "--ffn" in extra:
        held = [int(n) for n in re.findall(r"\((\d+) FFN layers held\)", results[0][1])]
        assert len(held) == ranks and 0 < sum(held) < 30, results[0][1][-2000:]
    got = {d["id"]: d["text"] for d in map(json.loads, out.read_text().splitlines())}
    want = engines(store_dir, backend).generate_batch(
        [[{"role": "user", "content": p}] for p, _ in BATCH], [n for _, n in BATCH]
    )
    assert [got[k] for k in range(len(BATCH))] == want


def test_a_batch_whose_kv_a_rank_cannot_hold_is_refused():
    from types import SimpleNamespace

    from mlx_flash.distributed.batch import check_kv_room
    from mlx_flash.errors import MemoryBudgetError

    work = [([1] * 100, 50), ([1] * 200, 50)]  # 400 tokens of KV
    check_kv_room(SimpleNamespace(kv_tokens=[400, 1000]), work)
    with pytest.raises(MemoryBudgetError, match="needs KV for 400 tokens.*rank 1's memory plan holds 399"):
        check_kv_room(SimpleNamespace(kv_tokens=[1000, 399]), work)


@pytest.mark.slow
@pytest.mark.full  # ~8 s; the default tier answers one-shot chats, a batch and the server across ranks
def test_the_repl_across_ranks_answers_as_one_process(store_dir, tmp_path):
    """`python -m mlx_flash.chat --pipeline` without --prompt: a conversation whose turns continue
    its caches on every rank (a second turn, /reset freeing them, a new conversation) prints what
    the one-process REPL prints."""
    lines = "What is the capital of France?\nAnd of Italy?\n/reset\nName a river.\n/quit\n"
    argv = ["-m", "mlx_flash.chat", "--model", store_dir, "--backend", "torch", "--max-tokens", "16"]
    one = subprocess.run([sys.executable, *argv], input=lines, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    procs = start_ranks(2, argv + ["--pipeline"], tmp_path, launcher="gloo", stdin=True)
    results = [p.communicate(lines if r == 0 else "", timeout=300) for r, p in enumerate(procs)]
    for r, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {err[-2000:]}"
    assert "(conversation cleared)" in one.stdout and results[0][0] == one.stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend,launcher", [pytest.param("torch", "gloo", marks=pytest.mark.full), ("mlx", "ring")])
def test_speculative_decoding_across_ranks_equals_plain_greedy(store_dir, backend, launcher, tmp_path):
    """Drafted tokens the verifier rejects are trimmed from every rank's caches (TRIM): the answer
    equals one process's plain greedy answer, and drafts were both kept and rejected on the way."""
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 2
    argv = [
        "-m",
        "mlx_flash.chat",
        "--model",
        store_dir,
        "--backend",
        backend,
        "--prompt",
        prompt.rstrip(),
        "--max-tokens",
        "40",
    ]
    one = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    procs = start_ranks(2, argv + ["--pipeline", "--speculative", "4", "--verbose"], tmp_path, launcher=launcher)
    results = [p.communicate(timeout=300) for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {err[-2000:]}"
    kept, proposed = map(int, re.search(r"speculative: (\d+) of (\d+) drafted", results[0][1]).groups())
    assert 0 < kept < proposed
    assert results[0][0] == one.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(port: int, path: str, body=None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    r = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode() if body else None,
        headers={"Content-Type": "application/json"},
        method="POST" if body else "GET",
    )
    try:
        with urllib.request.urlopen(r, timeout=120) as f:
            return f.status, json.loads(f.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _serve_ranks(store_dir, tmp_path, *extra):
    """Two ranks of `python -m mlx_flash.serve --pipeline` over gloo on a free port, once /health
    answers: (the port, the processes)."""
    port = _free_port()
    procs = start_ranks(
        2,
        [
            "-m",
            "mlx_flash.serve",
            "--model",
            store_dir,
            "--backend",
            "torch",
            "--pipeline",
            "--port",
            str(port),
            *extra,
        ],
        tmp_path,
        launcher="gloo",
    )
    for _ in range(240):
        try:
            if _http(port, "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.5)
    return port, procs


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="signals to processes of this machine")
def test_the_server_across_ranks_answers_then_503_once_a_rank_dies(store_dir, engines, tmp_path):
    """`python -m mlx_flash.serve --pipeline`: chat and completion answers equal one process's (a
    second turn continuing the first one's conversation; requests at once decoded together); once
    rank 1 is killed, requests and /health answer 503 naming it, and the server stays up until
    stopped."""
    port, procs = _serve_ranks(store_dir, tmp_path)
    try:
        first = [{"role": "user", "content": "What is the capital of France?"}]
        code, body = _http(port, "/v1/chat/completions", {"messages": first, "max_tokens": 12, "temperature": 0})
        assert code == 200, body
        answer = body["choices"][0]["message"]["content"]
        e = engines(store_dir, "torch")
        assert answer == e.generate(first, max_tokens=12)
        second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
        code, body = _http(port, "/v1/chat/completions", {"messages": second, "max_tokens": 12, "temperature": 0})
        assert code == 200 and body["choices"][0]["message"]["content"] == e.generate(second, max_tokens=12)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the first turn's caches continued
        code, body = _http(
            port, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        )
        assert code == 200 and body["choices"][0]["text"] == e.generate("The capital of France is", max_tokens=8)
        # requests at once decode together (a continuous batch across the ranks), each as it would alone
        prompts = ["The capital of France is", "Once upon a time", "The largest planet is", "Water boils at"]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(
                pool.map(
                    lambda q: _http(port, "/v1/completions", {"prompt": q, "max_tokens": 24, "temperature": 0}), prompts
                )
            )
        assert [code for code, _ in got] == [200] * len(prompts), got
        assert [b["choices"][0]["text"] for _, b in got] == [e.generate(q, max_tokens=24) for q in prompts]
        code, stats = _http(port, "/v1/stats")
        assert code == 200 and stats["pipeline"]["most_decoded_together"] >= 2, stats
        procs[1].kill()
        procs[1].wait()
        code, body = _http(port, "/v1/chat/completions", {"messages": first, "max_tokens": 4, "temperature": 0})
        assert code == 503 and "rank 1" in body["error"]["message"], body
        code, body = _http(port, "/health")
        assert code == 503 and "rank 1" in body["error"]
        procs[0].send_signal(signal.SIGINT)
        _, err = procs[0].communicate(timeout=60)
        assert "Traceback" not in err, err[-2000:]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
@pytest.mark.full  # ~12 s; the default tier names a stalled rank (chat) and serves 503 once a rank dies
@pytest.mark.skipif(sys.platform != "linux", reason="signals to processes of this machine")
def test_the_server_answers_503_when_a_rank_stalls(store_dir, tmp_path):
    """A stopped rank never answers and never drops its connection: the request waiting on it gets
    503 after --pipeline-timeout, later requests and /health at once, and the server keeps running
    (a chat or batch would exit instead)."""
    port, procs = _serve_ranks(store_dir, tmp_path, "--pipeline-timeout", "3")
    try:
        hello = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
        assert _http(port, "/v1/chat/completions", hello)[0] == 200
        procs[1].send_signal(signal.SIGSTOP)
        t = time.time()
        code, body = _http(port, "/v1/chat/completions", hello)
        assert code == 503 and "no answer from rank 1 within 3 s" in body["error"]["message"], body
        assert 2 < time.time() - t < 30
        t = time.time()
        assert _http(port, "/v1/chat/completions", hello)[0] == 503 and _http(port, "/health")[0] == 503
        assert _http(port, "/v1/stats")[0] == 503 and time.time() - t < 5
        assert procs[0].poll() is None  # still up, answering
        procs[0].send_signal(signal.SIGINT)
        procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
