"""The service under faults, on the real default model: a process SIGKILLed while it swaps out,
damaged (flipped, truncated, deleted) chunk files, a full disk during swap-out, garbage context
records; and how exact a restored context's KV is (read back: bit for bit; recomputed: measured).

The rule every test holds the service to: a context is either back with exactly the output a
never-disturbed context gives (greedy), or it is absent and svc.problems says so. Never silently
different output, never a temporary file left behind.
"""

import errno
import glob
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import mlx_flash
from mlx_flash.errors import ContextNotFoundError, FlashError
from mlx_flash import durable
from mlx_flash.service import swap_files
from mlx_flash.service.chunk_pool import ChunkShape
from mlx_flash.service.lifecycle import Restore
from mlx_flash.service import restore as restore_module
from mlx_flash.service.swap_files import HEADER, SwapError

pytestmark = pytest.mark.slow

BUDGET = "60MB"  # 81 chunks of 16 tokens: every context of these tests stays in memory until swapped out
MAX_TOKENS = 8
# Recomputed KV against KV computed turn by turn: float32 on the CPU, the same numbers up to the
# order of the sums (one batched pass over the chunks instead of the turns' prefills and one-token
# decode steps). Measured on this model, both backends: KV max |diff| 2.6e-5 (mlx) and 3.6e-5
# (torch) with |KV| up to 21, i.e. ~15 float32 ulps at that size; next-token logits 5.0e-5 and
# 5.8e-5. 1e-3 leaves a margin of ~20x for other CPUs and BLAS builds, and stays far below what a
# wrong restore gives (a chunk at the wrong position or from the wrong context: differences of
# order 1 to 10).
RECOMPUTE_TOL = 1e-3

CONVERSATION = (
    "You are a geography teacher.",
    ["What is the capital of France?", "And of Germany?", "Name a river that flows through it."],
)
# The SIGKILL test's contexts: distinct conversations, so a chunk landing in the wrong context shows;
# long questions, so they span several chunks for few decode steps.
CONVERSATIONS = [
    CONVERSATION,
    (
        "You answer in one short sentence.",
        [
            "Who wrote the play Hamlet, the tragedy about a prince of Denmark who seeks revenge for the murder of "
            "his father?",
            "When and where was he born?",
        ],
    ),
    (
        "You are a helpful cooking assistant.",
        [
            "I have eggs, butter, flour, sugar and milk in my kitchen. What simple dessert could I bake this "
            "afternoon for four people?",
            "How long does it bake?",
        ],
    ),
    (None, ["Count from one to ten, separated by commas.", "Now count backwards from ten to one."]),
]
EXTRA_TURN = "Thank you. Summarize our conversation in one sentence."


def user(text):
    return [{"role": "user", "content": text}]


def answer(svc, ctx, text, max_tokens=MAX_TOKENS):
    return "".join(s.text for s in svc.call(ctx, user(text), max_tokens=max_tokens, temperature=0.0))


def states(engine, ctx, n=None):
    """Every layer's (keys, values) of the context as numpy, the first n tokens."""
    out = []
    for c in ctx.table.caches():
        k, v = c.state(engine.ops)
        out.append((k[:, :, :n], v[:, :, :n]))
    return out


def max_diff(a, b):
    return max(max(float(np.abs(x[0] - y[0]).max()), float(np.abs(x[1] - y[1]).max())) for x, y in zip(a, b))


def identical(a, b):
    return all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))


def temporaries(directory):
    return glob.glob(os.path.join(directory, "contexts", "*", "*.tmp-*"))


def chunk_files(directory):
    return [p for p in glob.glob(os.path.join(directory, "contexts", "*", "chunk-*")) if ".tmp-" not in p]


def build(svc, conversation):
    system, turns = conversation
    ctx = svc.new_context(system=system)
    for t in turns:
        answer(svc, ctx, t)
    return ctx


@pytest.fixture(scope="module")
def torch_engine(engines, store_dir):
    return engines(store_dir, "torch")


@pytest.fixture(scope="module")
def reference(torch_engine, tmp_path_factory):
    """The conversation in a service that never swaps: its messages after the turns, its KV, and
    its answer to one more turn."""
    svc = mlx_flash.Service(torch_engine, directory=str(tmp_path_factory.mktemp("reference")), kv_budget=BUDGET)
    ctx = build(svc, CONVERSATION)
    c = svc.get(ctx)
    ref = {
        "messages": [dict(m) for m in c.messages],
        "kv_tokens": c.kv_tokens,
        "states": states(torch_engine, c),
        "chunks": len(c.table.slots),
    }
    ref["next"] = answer(svc, ctx, EXTRA_TURN)
    assert ref["next"] and ref["chunks"] >= 4  # the damage tests hit a middle chunk of several
    svc.close()
    return ref


def swapped_context(engine, directory, reference):
    """A service in `directory` holding CONVERSATION swapped out (every chunk on flash, none in memory)."""
    svc = mlx_flash.Service(engine, directory=directory, kv_budget=BUDGET)
    ctx = build(svc, CONVERSATION)
    c = svc.get(ctx)
    assert c.messages == reference["messages"]  # greedy turns are deterministic
    svc.swap_out(ctx)
    assert not c.chunks_in_memory() and all(d is not None for d in c.disk)
    return svc, ctx


# ---- 1. SIGKILL during swap-out, then a restart ----------------------------------------------------

CHILD = textwrap.dedent("""
    import json, sys, time
    import mlx_flash

    store, directory, budget, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    conversations = json.loads(sys.argv[5])
    engine = mlx_flash.load(store, backend="torch", ffn="resident", torch_dtype="float32", progress=False)
    svc = mlx_flash.Service(engine, directory=directory, kv_budget=budget)
    ids = []
    for system, turns in conversations:
        ctx = svc.new_context(system=system)
        print("created", ctx, flush=True)
        for t in turns:
            for _ in svc.call(ctx, [{"role": "user", "content": t}], max_tokens=max_tokens, temperature=0.0):
                pass
        ids.append(ctx)
    print("state", json.dumps([svc.get(c).messages for c in ids]), flush=True)
    print("writing", flush=True)
    t = time.perf_counter()
    svc.flush()
    print("flushed", time.perf_counter() - t, flush=True)
    time.sleep(60)  # the parent kills it
""")


def _run_and_kill(script, store_dir, directory, ready, extra_s, log):
    """Run the child until it says "writing", then SIGKILL it `extra_s` seconds after ready(directory)
    (the folder is polled: the kill lands at that point of the writes whatever the machine's
    speed); returns (created ids, reported messages per context, whether it had finished flushing)."""
    with open(log, "w") as err:
        p = subprocess.Popen(
            [sys.executable, script, store_dir, directory, BUDGET, str(MAX_TOKENS), json.dumps(CONVERSATIONS)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        created, messages = [], None
        watchdog = threading.Timer(600, p.kill)  # a child stuck before "writing" fails the test, never hangs it
        watchdog.start()
        try:
            for line in p.stdout:
                word, _, rest = line.rstrip("\n").partition(" ")
                if word == "created":
                    created.append(rest)
                elif word == "state":
                    messages = json.loads(rest)
                elif word == "writing":
                    while not ready(directory) and p.poll() is None:
                        time.sleep(0.0002)
                    time.sleep(extra_s)
                    p.send_signal(signal.SIGKILL)
                    break
            else:
                p.wait()
            rest = p.stdout.read()  # whatever it printed before the kill
        finally:
            watchdog.cancel()
            if p.poll() is None:
                p.kill()
            p.wait()
    if p.returncode != -signal.SIGKILL:
        with open(log) as f:
            pytest.fail(f"the child ended (status {p.returncode}) before it was killed:\n{f.read()[-3000:]}")
    return created, messages, "flushed" in rest


@pytest.mark.full  # ~30 s: a child killed mid swap-out, then a restart; the other fault tests cover restores
def test_sigkill_during_swap_out_then_restart(torch_engine, store_dir, tmp_path):
    engine = torch_engine
    # The never-killed reference: the same conversations in this process, flushed, then one more
    # turn each on the KV they computed.
    ref_svc = mlx_flash.Service(engine, directory=str(tmp_path / "reference"), kv_budget=BUDGET)
    ref_ids = [build(ref_svc, conv) for conv in CONVERSATIONS]
    ref_messages = [[dict(m) for m in ref_svc.get(c).messages] for c in ref_ids]
    per_context = [len(ref_svc.get(c).table.slots) for c in ref_ids]
    ref_svc.flush()
    n_chunks = len(chunk_files(str(tmp_path / "reference")))
    assert n_chunks == sum(per_context) and n_chunks >= 16
    ref_next = [answer(ref_svc, c, EXTRA_TURN) for c in ref_ids]
    ref_svc.close()

    script = str(tmp_path / "child.py")
    with open(script, "w") as f:
        f.write(CHILD)
    rng = random.Random(1234)

    # Where the kills land: after the first context's last chunk file (its record is being written),
    # while a chunk file is half written (a temporary exists), after random chunk files; each 0-3 ms
    # later (into the next write) but the second. More random ones if none of those cut a write or
    # left a temporary for the restart to remove.
    def after(k):
        return lambda d: len(chunk_files(d)) >= k

    def writing_chunk(k):
        return lambda d: len(chunk_files(d)) >= k and any("chunk-" in os.path.basename(t) for t in temporaries(d))

    first = per_context[0]
    k1, k2, k3 = rng.sample([k for k in range(1, n_chunks) if k != first], 3)
    plan = [
        (f"after chunk file {first}", after(first), rng.uniform(0, 0.003)),
        (f"writing chunk file {k1 + 1}", writing_chunk(k1), 0.0),
        (f"after chunk file {k2}", after(k2), rng.uniform(0, 0.003)),
        (f"after chunk file {k3}", after(k3), rng.uniform(0, 0.003)),
    ]
    mid_write = left_temporaries = 0
    runs = []
    for run in range(8):
        if run >= len(plan):
            if mid_write and left_temporaries:
                break
            k4 = rng.randrange(1, n_chunks)
            plan.append((f"writing chunk file {k4 + 1}", writing_chunk(k4), 0.0))
        where, ready, extra = plan[run]
        directory = str(tmp_path / f"run{run}")
        created, messages, finished = _run_and_kill(
            script, store_dir, directory, ready, extra, str(tmp_path / f"run{run}.log")
        )
        assert len(created) == len(CONVERSATIONS)
        assert messages == ref_messages, "the child's greedy conversations differ from this process's"
        # What the kill left: a write was cut when a temporary exists or only some chunks are on flash.
        left_tmp, left_chunks = len(temporaries(directory)), len(chunk_files(directory))
        mid_write += left_tmp > 0 or 0 < left_chunks < n_chunks
        left_temporaries += left_tmp > 0

        # The restart: a new service on the directory (this process never saw it).
        svc = mlx_flash.Service(engine, directory=directory, kv_budget=BUDGET)
        assert temporaries(directory) == [], "the restart left temporaries of the killed writer"
        read = recomputed = bad = 0
        for k, ctx in enumerate(created):
            if ctx not in svc.contexts:
                assert any(ctx in p for p in svc.problems), f"context {ctx} vanished unreported: {svc.problems}"
                continue
            assert svc.get(ctx).messages == ref_messages[k]
            out = answer(svc, ctx, EXTRA_TURN)
            r = svc.last.restore
            read, recomputed, bad = read + r.chunks_read, recomputed + r.chunks_recomputed, bad + len(r.bad_files)
            assert out == ref_next[k], (
                f"run {run} (killed {extra * 1e3:.1f} ms {where}): context {k} answers "
                f"{out!r}, the never-killed one {ref_next[k]!r}"
            )
        for p in svc.problems:  # a problem names a context that is absent, never one still served
            assert not any(c in p and c in svc.contexts for c in created), p
        runs.append(
            f"killed {extra * 1e3:.1f} ms {where}: left {left_chunks:2d}/{n_chunks} "
            f"chunk files, {left_tmp} temporaries{' (flush done)' if finished else ''}; restart: "
            f"{len(svc.contexts)} contexts, {read} chunks read, {recomputed} recomputed, {bad} bad, "
            f"{len(svc.problems)} problems"
        )
        svc.close()
    print(f"\nchunks per context {per_context}\n" + "\n".join(runs))
    assert mid_write, "no kill landed while chunk files were being written"
    assert left_temporaries, "no kill left a temporary file: the restart's clean-up was not exercised"


# ---- 2, 3. Damaged chunk files ---------------------------------------------------------------------


def _flip(path):
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        data = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate_payload(path):
    os.truncate(path, HEADER + (os.path.getsize(path) - HEADER) // 2)


def _truncate_header(path):
    os.truncate(path, 100)


def _empty(path):
    os.truncate(path, 0)


DAMAGE = {
    "flip-bytes": _flip,
    "truncate-payload": _truncate_payload,
    "truncate-header": _truncate_header,
    "empty": _empty,
    "delete": os.unlink,
}


def _check_damaged_chunk_is_not_used(engine, tmp_path, reference, damage):
    svc, ctx = swapped_context(engine, str(tmp_path), reference)
    c = svc.get(ctx)
    n_chunks = len(c.table.slots)
    bad = 1  # a middle chunk: chunks before it and after it are read (a fresh service's cost model reads all)
    path = svc.swap.chunk_path(ctx, bad)
    assert os.path.exists(path)
    DAMAGE[damage](path)
    out = answer(svc, ctx, EXTRA_TURN)
    r = svc.last.restore
    assert any(path in line for line in r.bad_files), r.bad_files
    assert r.chunks_recomputed >= 1 and r.chunks_read + r.chunks_recomputed == n_chunks, r
    assert r.chunks_read >= n_chunks - 1, "one bad file should not throw away the good ones"
    # The KV the call started from: the damaged chunk recomputed (close), the others read (exact).
    n = svc.last.cached_tokens
    C = svc.shape.tokens
    assert n > (bad + 1) * C
    got, want = states(engine, c, n), [(k[:, :, :n], v[:, :, :n]) for k, v in reference["states"]]
    diff = max_diff(got, want)
    print(f"{damage}: {r.bad_files}; KV of the recomputed chunk differs by {diff:.2e}")
    assert diff < RECOMPUTE_TOL
    outside = [
        (np.delete(k, np.s_[bad * C : (bad + 1) * C], axis=2), np.delete(v, np.s_[bad * C : (bad + 1) * C], axis=2))
        for k, v in got
    ]
    want_outside = [
        (np.delete(k, np.s_[bad * C : (bad + 1) * C], axis=2), np.delete(v, np.s_[bad * C : (bad + 1) * C], axis=2))
        for k, v in want
    ]
    assert identical(outside, want_outside)
    assert out == reference["next"]
    # The damaged file is no longer the chunk's current file.
    with open(os.path.join(svc.swap.folder(ctx), swap_files.RECORD), "rb") as f:
        rec = swap_files.parse_record(f.read())
    assert rec["disk"][bad] is None and all(rec["disk"][i] is not None for i in range(n // C) if i != bad)
    assert temporaries(str(tmp_path)) == []
    svc.close()


def test_corrupted_chunk_file_is_recomputed(torch_engine, tmp_path, reference):
    _check_damaged_chunk_is_not_used(torch_engine, tmp_path, reference, "flip-bytes")


@pytest.mark.parametrize(
    "damage",
    [
        "truncate-payload",
        pytest.param("truncate-header", marks=pytest.mark.full),
        pytest.param("empty", marks=pytest.mark.full),
        "delete",
    ],
)
def test_truncated_or_deleted_chunk_file_is_recomputed(torch_engine, tmp_path, reference, damage):
    _check_damaged_chunk_is_not_used(torch_engine, tmp_path, reference, damage)


# ---- 4. Full disk during swap-out ------------------------------------------------------------------


class FullDisk:
    """`os` as the durable writes see it, on a disk with `room` bytes left: os.write writes what fits, then
    fails with ENOSPC. Records the files whose write failed."""

    def __init__(self, room):
        self.room, self.paths, self.failed = room, {}, []

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777, **kw):
        fd = os.open(path, flags, mode, **kw)
        self.paths[fd] = path
        return fd

    def write(self, fd, data):
        data = memoryview(data).cast("B")
        if self.room <= 0:
            self.failed.append(self.paths.get(fd, "?"))
            raise OSError(errno.ENOSPC, "No space left on device")
        n = os.write(fd, data[: self.room])
        self.room -= n
        return n


def _full_disk_swap_out(engine, directory, monkeypatch, fail_at):
    """A context built in a new service, then swap_out on a disk that fills up at `fail_at`:
    returns (service, context id, the SwapError, the files whose write failed, KV and slots before)."""
    svc = mlx_flash.Service(engine, directory=directory, kv_budget=BUDGET)
    ctx = build(svc, CONVERSATION)
    c = svc.get(ctx)
    before = (states(engine, c), list(c.table.slots), svc.pool.free_slots)
    file_bytes = HEADER + svc.shape.nbytes
    room = {
        "first-chunk": 100,
        "second-chunk": file_bytes + file_bytes // 3,
        "record": len(c.table.slots) * file_bytes + 10,
    }[fail_at]
    disk = FullDisk(room)
    monkeypatch.setattr(durable, "os", disk)
    with pytest.raises(SwapError) as e:
        svc.swap_out(ctx)
    monkeypatch.undo()  # space again
    failed = [p.split(".tmp-")[0] for p in disk.failed]
    print(f"{fail_at}: {e.value}; writes that failed: {[os.path.basename(p) for p in failed]}")
    return svc, ctx, e.value, failed, before


# the second chunk's failure (the first's path, one chunk later) runs in the full tier
@pytest.mark.parametrize("fail_at", ["first-chunk", pytest.param("second-chunk", marks=pytest.mark.full), "record"])
def test_full_disk_during_swap_out(torch_engine, tmp_path, reference, monkeypatch, fail_at):
    engine = torch_engine
    directory = str(tmp_path)
    svc, ctx, err, failed, (kv, slots, free) = _full_disk_swap_out(engine, directory, monkeypatch, fail_at)
    msg = str(err)
    assert isinstance(err, FlashError) and "\n" not in msg
    assert "the disk is full" in msg
    assert failed and any(p in msg for p in failed), "the message names no file whose write failed"
    if fail_at != "record":  # the chunk file that did not fit, not the record that could not follow it
        assert failed[0].endswith(".kv") and failed[0] in msg, (msg, failed)
    # Still fully in memory, untouched.
    c = svc.get(ctx)
    assert c.table.slots == slots and svc.pool.free_slots == free
    assert identical(states(engine, c), kv)
    assert temporaries(directory) == []
    # What is on flash is still a readable record (the old one, or the new one).
    other = mlx_flash.Service(engine, directory=directory, kv_budget="5MB")
    assert ctx in other.contexts and other.problems == []
    other.close()
    # The next call answers as the never-swapped context does, from memory.
    assert answer(svc, ctx, EXTRA_TURN) == reference["next"]
    assert svc.last.restore.chunks_read + svc.last.restore.chunks_recomputed == 0
    # And a swap-out with space works, and reads back the same.
    kv = states(engine, c)
    svc.swap_out(ctx)
    assert not c.chunks_in_memory() and temporaries(directory) == []
    r = svc.bring_back(ctx, Restore.READ)
    assert not r.bad_files and identical(states(engine, c), kv)
    svc.close()


def _budget_full_of_another_context(engine, directory):
    """A service of eight chunks, all held by one context (119 tokens); returns (service, its id)."""
    a = engine.args
    chunk_bytes = ChunkShape(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 16).nbytes  # float32 on the CPU
    svc = mlx_flash.Service(engine, directory=directory, kv_budget=8 * chunk_bytes)
    other = svc.new_context()
    answer(
        svc, other, "Please repeat after me: " + "one two three four five six seven eight nine ten " * 8, max_tokens=4
    )
    assert len(svc.get(other).table.slots) == 8 and svc.pool.free_slots == 0  # the whole budget
    return svc, other


def test_full_disk_during_eviction(torch_engine, tmp_path, reference, monkeypatch):
    """A call that must evict another context's chunks while the disk is full fails with SwapError
    before its first token, leaving both contexts as they were; with space again the same call
    answers as in a service that never swapped."""
    engine = torch_engine
    svc, other = _budget_full_of_another_context(engine, str(tmp_path))
    o = svc.get(other)
    other_kv, other_slots = states(engine, o), list(o.table.slots)
    system, turns = CONVERSATION
    ctx = svc.new_context(system=system)
    monkeypatch.setattr(durable, "os", FullDisk(0))
    steps = []
    with pytest.raises(SwapError, match="the disk is full"):
        for step in svc.call(ctx, user(turns[0]), max_tokens=MAX_TOKENS):
            steps.append(step)
    monkeypatch.undo()
    assert steps == []
    c = svc.get(ctx)
    assert c.messages == reference["messages"][:1] and c.kv_tokens == 0 and not c.table.slots
    assert o.table.slots == other_slots and identical(states(engine, o), other_kv)
    assert temporaries(str(tmp_path)) == []
    # Space again: other's chunks go to flash and the call answers as the reference's first turn.
    assert answer(svc, ctx, turns[0]) == reference["messages"][2]["content"]
    assert svc.last.evicted_chunks >= 2 and svc.last.written_chunks >= 2
    # And other's evicted chunks come back from flash bit for bit.
    assert o.chunks_in_memory() != list(range(8))
    r = svc.bring_back(other, Restore.READ)
    assert r.chunks_read >= 2 and not r.bad_files and identical(states(engine, o), other_kv)
    svc.close()


@pytest.mark.parametrize("room", ["none", "two-chunks"])
def test_full_disk_during_eviction_error_names_the_chunk_file(torch_engine, tmp_path, monkeypatch, room):
    """none: the call fails making room before its first token (other's chunk 0); two-chunks: it
    evicts two chunks, then fails on the third when its decode needs one more slot."""
    engine = torch_engine
    svc, other = _budget_full_of_another_context(engine, str(tmp_path))
    system, turns = CONVERSATION
    ctx = svc.new_context(system=system)
    disk = FullDisk({"none": 0, "two-chunks": 2 * (HEADER + svc.shape.nbytes) + 50_000}[room])  # + other's record
    monkeypatch.setattr(durable, "os", disk)
    with pytest.raises(SwapError) as e:
        answer(svc, ctx, turns[0])
    monkeypatch.undo()
    chunk = svc.swap.chunk_path(other, {"none": 0, "two-chunks": 2}[room])
    print(f"{room}: {e.value}; writes that failed: {[os.path.basename(p.split('.tmp-')[0]) for p in disk.failed]}")
    assert disk.failed[0].split(".tmp-")[0] == chunk, f"the first write that failed is {disk.failed[0]}"
    assert chunk in str(e.value)
    svc.close()


# ---- 5. Restore: bit-exact by reading, close and same tokens by recomputing ------------------------


# MLX in the full tier (~6 s): its chunked KV restores exactly in tests/service/test_service.py
@pytest.mark.parametrize("backend", [pytest.param("mlx", marks=pytest.mark.full), "torch"])
def test_restore_is_bit_exact_by_reading_and_close_by_recomputing(engines, store_dir, tmp_path, backend, monkeypatch):
    monkeypatch.setattr(restore_module, "PLACE_CHUNKS", 4)  # the chunks read are placed in two batches
    engine = engines(store_dir, backend)
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget=BUDGET)
    a = build(svc, CONVERSATION)  # swapped and restored
    b = build(svc, CONVERSATION)  # its twin, never swapped
    ca, cb = svc.get(a), svc.get(b)
    assert ca.messages == cb.messages and ca.kv_tokens == cb.kv_tokens
    n = ca.kv_tokens
    twin = states(engine, cb)
    assert identical(states(engine, ca), twin)  # same computation in other slots
    # Read back only.
    svc.swap_out(a)
    assert not ca.chunks_in_memory()
    r = svc.bring_back(a, Restore.READ)
    assert r.chunks_read == len(ca.table.slots) and r.chunks_recomputed == 0 and not r.bad_files
    assert identical(states(engine, ca), twin), "KV read back from swap files is not bit for bit the original"
    # Recomputed only.
    svc.swap_out(a)
    r = svc.bring_back(a, Restore.RECOMPUTE)
    assert r.chunks_recomputed == len(ca.table.slots) and r.chunks_read == 0
    rec = states(engine, ca)
    kv_diff = max_diff(rec, twin)
    scale = max(max(float(np.abs(k).max()), float(np.abs(v).max())) for k, v in twin)
    # Logits of one more token on each.
    probe = engine.tokenizer.encode(" Paris")[:1]
    la = engine.forward(probe, ca.table.caches(), all_logits=True)
    lb = engine.forward(probe, cb.table.caches(), all_logits=True)
    ca.table.truncate(n), cb.table.truncate(n)
    logit_diff = float(np.abs(la - lb).max())
    print(
        f"{backend}: recomputed KV max |diff| {kv_diff:.2e} (|KV| up to {scale:.1f}), "
        f"next-token logits max |diff| {logit_diff:.2e}"
    )
    assert kv_diff < RECOMPUTE_TOL and logit_diff < RECOMPUTE_TOL
    assert int(np.argmax(la)) == int(np.argmax(lb))
    out_a, out_b = answer(svc, a, EXTRA_TURN), answer(svc, b, EXTRA_TURN)
    assert out_a == out_b and out_a
    svc.close()


# ---- 6. A garbage context record -------------------------------------------------------------------


def _edited_token(record: bytes) -> bytes:
    """The record with the first digit of its token sequence changed: the same length, valid JSON."""
    at = record.index(b'"sequence":[') + len(b'"sequence":[')
    digit = record[at : at + 1]
    return record[:at] + (b"1" if digit != b"1" else b"2") + record[at + 1 :]


def _garbage(record_bytes, other_record):
    return {
        "random-bytes": b"\x00\xff\xfe garbage {{{ \x80\x81",
        "truncated-json": record_bytes[: len(record_bytes) // 2],
        "json-list": b"[1, 2, 3]",
        "wrong-fields": swap_files.record_bytes(
            {**swap_files.parse_record(record_bytes), "sequence": "oops", "kv_tokens": -4}
        ),
        # valid JSON, one token of the conversation changed, the checksum line kept: the edit is caught
        "edited-token": _edited_token(record_bytes),
        "plain-json": record_bytes.partition(b"\n")[2],  # no checksum line (a record of an older version)
        "another-contexts-record": other_record,
        "deeply-nested": b"[" * 100000 + b"]" * 100000,
        "empty": b"",
    }


# The default tier damages a record two ways (cut, another context's); the other five (~22 s) run in
# the full tier.
GARBAGE = [
    pytest.param("random-bytes", marks=pytest.mark.full),
    "truncated-json",
    pytest.param("json-list", marks=pytest.mark.full),
    pytest.param("wrong-fields", marks=pytest.mark.full),
    "another-contexts-record",
    "edited-token",
    pytest.param("plain-json", marks=pytest.mark.full),
    pytest.param("deeply-nested", marks=pytest.mark.full),
    pytest.param("empty", marks=pytest.mark.full),
]


@pytest.mark.parametrize("kind", GARBAGE)
def test_garbage_context_record(torch_engine, tmp_path, reference, kind):
    engine = torch_engine
    directory = str(tmp_path)
    svc = mlx_flash.Service(engine, directory=directory, kv_budget=BUDGET)
    broken = svc.new_context(system="You answer in one short sentence.")
    answer(svc, broken, "Who wrote Hamlet?")
    good = build(svc, CONVERSATION)
    svc.flush()
    svc.close()
    path = os.path.join(directory, "contexts", broken, swap_files.RECORD)
    with open(path, "rb") as f:
        record = f.read()
    with open(os.path.join(directory, "contexts", good, swap_files.RECORD), "rb") as f:
        other = f.read()
    with open(path, "wb") as f:
        f.write(_garbage(record, other)[kind])

    svc = mlx_flash.Service(engine, directory=directory, kv_budget=BUDGET)
    print(f"{kind}: {svc.problems}")
    assert broken not in svc.contexts
    assert len(svc.problems) == 1 and broken in svc.problems[0] and "\n" not in svc.problems[0]
    with pytest.raises(ContextNotFoundError):
        svc.get(broken)
    assert [d["id"] for d in svc.list()] == [good]
    # The other context comes back from flash and answers as the never-swapped one.
    assert svc.get(good).messages == reference["messages"]
    assert answer(svc, good, EXTRA_TURN) == reference["next"]
    assert svc.last.restore.chunks_read > 0 and not svc.last.restore.bad_files
    # New contexts still work; the broken one's folder is left for a person to look at.
    fresh = build(svc, CONVERSATION)
    assert answer(svc, fresh, EXTRA_TURN) == reference["next"]
    assert os.path.exists(path)
    svc.close()
