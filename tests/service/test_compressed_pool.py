"""Compressed chunks held in the pool's arena at their width (service/coded_chunks.py,
kv_memory.compress): a context whose complete chunks sit there as codes computes exactly what it
computes over their dequantized float copy (a tiny random llama, both backends, one context and a
decode batch); and on the default model, a service with compression holds more contexts in one
KV budget the narrower the chunks, swaps a compressed context out and back through its codes, and
continues it with the tokens it would have produced without the swap."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.errors import MemoryBudgetError
from mlx_flash.service.chunk_pool import ChunkPool, ChunkShape
from mlx_flash.service.chunked_kv import ChunkTable, chunked_batch_caches
from mlx_flash.service.coded_chunks import encode, packed_bytes
from mlx_flash.service.compression import lossy
from mlx_flash.service.lifecycle import Restore
from mlx_flash.batching.schedule import MicroBatch, Order, run_block
from mlx_flash.service.running_batch import RunningBatch


@pytest.fixture(params=["torch", "mlx"])
def tiny(request, tiny_store):
    store, _ = tiny_store("llama", num_attention_heads=2)  # head_dim 32: values' groups of 32 channels
    with mlx_flash.load(store, backend=request.param, ffn="resident", progress=False) as e:
        yield e


def _prefilled(e, pool, tokens):
    t = ChunkTable(pool)
    caches = t.caches()
    e.forward(tokens, caches)
    t.tokens = caches[0].offset
    return t


def _compress(pool, table, widths, coded: bool):
    """The table's complete chunks at `widths` (cycled): into the arena (coded) or as their float copy."""
    C = pool.shape.tokens
    for i in range(table.tokens // C):
        w = widths[i % len(widths)]
        x = pool.export([table.slots[i]])[0]
        if coded:
            new = pool.place_coded(np.frombuffer(encode(x, w), np.uint8), w)
            pool.release(table.slots[i])
            table.slots[i] = new
        else:
            pool.load([table.slots[i]], lossy(x, w)[None])


def test_codes_where_they_lie_compute_what_their_float_copy_computes(tiny):
    e = tiny
    a = e.args
    shape = ChunkShape(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 8)
    pool = ChunkPool(e.ops, shape, 24, coded_bytes=12 * packed_bytes(shape.array_shape, 8))
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 96, size=29).tolist()
    coded, floats = _prefilled(e, pool, prompt), _prefilled(e, pool, prompt)
    _compress(pool, coded, (4, 2, 8), True)
    _compress(pool, floats, (4, 2, 8), False)
    assert all(s < 0 for s in coded.slots[:3]) and coded.slots[3] >= 0  # three complete chunks coded, one float
    nxt = rng.integers(3, 96, size=3).tolist()
    got = np.array(e.forward(nxt, coded.caches()))
    want = np.array(e.forward(nxt, floats.caches()))
    assert np.array_equal(got, want)
    exact = _prefilled(e, pool, prompt)  # the codes are not the floats: the comparison can fail
    assert not np.array_equal(np.array(e.forward(nxt, exact.caches())), want)
    # a decode batch over a coded row and a float one: each row as it computes alone
    other = _prefilled(e, pool, rng.integers(3, 96, size=13).tolist())
    alone = [np.array(e.forward([7], t.caches())) for t in (coded, other)]  # (t.tokens stays: the batch rewrites it)
    caches = chunked_batch_caches([t.caches() for t in (coded, other)])
    (logits,) = run_block(e, [MicroBatch(e.ops.tokens([[7], [7]]), caches)], Order.ZIGZAG)
    logits = np.asarray(logits)
    for b in range(2):
        assert np.abs(logits[b, -1] - alone[b][-1]).max() < 1e-4


def user(text):
    return [{"role": "user", "content": text}]


def _resident(engine, tmp_path, compression, name):
    svc = mlx_flash.Service(engine, directory=str(tmp_path / name), kv_budget=24 * 737280, kv_compression=compression)
    for k in range(14):  # 3 complete chunks and a token each
        ctx = svc.new_context()
        list(svc.call(ctx, f"Note {k}: " + "the river runs past the old mill and on to the sea. " * 4, max_tokens=4))
    s = svc.stats()
    svc.close()
    return s.contexts_resident


@pytest.mark.slow
@pytest.mark.full  # ~30 s: python -m mlx_flash.bench kv-capacity measures it at scale; the tests above run the codes
def test_narrower_chunks_hold_more_contexts_in_one_budget(engines, store_dir, tmp_path):
    engine = engines(store_dir, "torch")
    held = {c: _resident(engine, tmp_path, c, c.replace(":", "")) for c in ("off", "static:8", "static:4")}
    print(f"contexts held wholly in memory: {held}")
    assert held["off"] < held["static:8"] < held["static:4"]


@pytest.mark.slow
def test_a_compressed_context_swaps_through_its_codes_and_continues_as_unswapped(engines, store_dir, tmp_path):
    engine = engines(store_dir, "torch")
    outs = []
    for swap in (False, True):
        svc = mlx_flash.Service(
            engine, directory=str(tmp_path / str(swap)), kv_budget="40MB", kv_compression="static:4"
        )
        ctx = svc.new_context()
        list(svc.call(ctx, user("What is the capital of France?"), max_tokens=24))
        c = svc.get(ctx)
        in_arena = [i for i, s in enumerate(c.table.slots) if s is not None and s < 0]
        assert in_arena == list(range(len(c.table.slots)))  # complete chunks as codes, the last as floats
        assert c.widths == [4] * (c.kv_tokens // 16) + [0] * (c.kv_tokens % 16 > 0)
        if swap:
            before = [x.state(engine.ops) for x in c.table.caches()]
            svc.swap_out(ctx)
            report = svc.bring_back(ctx, Restore.READ)
            assert report.chunks_read == len(c.table.slots) and not report.bad_files
            assert all(c.table.slots[i] < 0 for i in range(c.kv_tokens // 16))  # back in the arena, as codes
            after = [x.state(engine.ops) for x in c.table.caches()]
            assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(before, after))
        outs.append("".join(s.text for s in svc.call(ctx, user("And of Germany?"), max_tokens=16)))
        svc.close()
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_a_call_beyond_the_float_slots_is_refused_naming_them(engines, store_dir, tmp_path):
    svc = mlx_flash.Service(
        engines(store_dir, "torch"), directory=str(tmp_path), kv_budget=8 * 737280, kv_compression="static:4"
    )
    assert svc.pool.n_slots == 2 and svc.max_tokens > 8 * 16  # two float chunks; the arena holds more than float would
    ctx = svc.new_context()
    with pytest.raises(MemoryBudgetError, match="float chunks .* cannot hold 4 more chunks"):
        list(svc.call(ctx, "word " * 60, max_tokens=1))
    assert not svc.get(ctx).pinned
    svc.close()


@pytest.mark.slow
def test_a_fork_of_a_compressed_context_writes_its_own_chunks_and_both_survive_a_restart(engines, store_dir, tmp_path):
    engine = engines(store_dir, "torch")
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget="40MB", kv_compression="static:4")
    a = svc.new_context()
    list(svc.call(a, "The river runs past the old mill and on to the sea, where the boats wait. " * 3, max_tokens=12))
    ca = svc.get(a)
    before = [x.state(engine.ops) for x in ca.table.caches()]
    b = svc.fork(a, 20)  # inside a compressed chunk (tokens 16-31)
    cb = svc.get(b)
    assert cb.table.slots[1] == ca.table.slots[1] < 0 and cb.widths[:2] == [4, 4]
    list(svc.call(b, " Then it rains.", max_tokens=6))
    assert cb.table.slots[1] != ca.table.slots[1]  # its copy, decoded to be written into, then compressed again
    after = [x.state(engine.ops) for x in ca.table.caches()]
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(before, after))
    held = {c: [x.state(engine.ops) for x in svc.get(c).table.caches()] for c in (a, b)}
    svc.flush()
    svc.close()
    again = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget="40MB", kv_compression="static:4")
    assert not again.problems
    for c in (a, b):
        report = again.bring_back(c, Restore.READ)
        assert not report.bad_files and report.chunks_recomputed == 0
        now = [x.state(engine.ops) for x in again.get(c).table.caches()]
        assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(held[c], now))
    again.close()


def test_the_running_batch_over_compressed_contexts_answers_as_each_call_alone(tiny_store, tmp_path):
    """Second turns of three contexts whose first turns left them compressed: run together in the
    server's batch (prompts packed into one pass, each row's compressed chunks gathered there;
    decode steps over the codes where they lie), each gives the greedy tokens it gives alone."""
    store, _ = tiny_store("llama", num_attention_heads=2)
    rng = np.random.default_rng(5)
    first = [rng.integers(3, 96, size=n).tolist() for n in (40, 21, 35)]
    second = [rng.integers(3, 96, size=n).tolist() for n in (5, 9, 3)]
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False, prefill_chunk=16) as e:
        results = []
        for together in (False, True):
            with mlx_flash.Service(e, directory=str(tmp_path / str(together)), kv_budget="4MB",
                                   kv_compression="static:4") as svc:  # fmt: skip
                ids = [svc.new_context() for _ in first]
                for c, t in zip(ids, first):
                    list(svc.call(c, e.tokenizer.decode(t), max_tokens=4))
                assert all(svc.get(c).table.slots[0] < 0 for c in ids)  # compressed, in the arena
                if not together:
                    results.append(
                        [
                            [s.token for s in svc.call(c, e.tokenizer.decode(t), max_tokens=8)]
                            for c, t in zip(ids, second)
                        ]
                    )
                    continue
                batch = RunningBatch(svc)
                calls = [batch.start(c, e.tokenizer.decode(t), max_tokens=8)[0] for c, t in zip(ids, second)]
                got = {id(c): [] for c in calls}
                while batch.calls:
                    for c, step in batch.step():
                        got[id(c)].append(step.token)
                results.append([got[id(c)] for c in calls])
    assert results[0] == results[1]


def test_a_prompt_longer_than_the_float_slots_compresses_its_written_chunks_as_it_goes(tiny_store, tmp_path):
    """Three float chunks, prefill pieces of one chunk: a 100-token prompt (7 chunks) runs, its chunks
    written by every layer moving to the arena whenever the float slots run out; the same call in a
    fresh service answers the same."""
    store, _ = tiny_store("llama", num_attention_heads=2)
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, 96, size=100).tolist()
    answers = []
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False, prefill_chunk=16) as e:
        chunk = 2 * e.args.num_hidden_layers * e.args.num_key_value_heads * e.args.head_dim * 16 * 4
        for k in range(2):
            with mlx_flash.Service(e, directory=str(tmp_path / str(k)), kv_budget=12 * chunk,
                                   kv_compression="static:4") as svc:  # fmt: skip
                assert svc.pool.n_slots == 3
                ctx = svc.new_context()
                answers.append([s.token for s in svc.call(ctx, e.tokenizer.decode(prompt), max_tokens=8)])
                c = svc.get(ctx)
                assert len(answers[-1]) == 8 and c.kv_tokens > 100
                assert all(s < 0 for s in c.table.slots) and c.widths[:6] == [4] * 6  # all in the arena
    assert answers[0] == answers[1]


def test_the_running_batch_prefills_a_prompt_longer_than_the_float_slots(tiny_store, tmp_path):
    """The server's batch takes the same long prompt in pieces of two chunks (three float chunks): each
    claim it makes before a pass may move the call's written chunks to the arena, and it answers as
    Service.call does."""
    store, _ = tiny_store("llama", num_attention_heads=2)
    prompt = np.random.default_rng(8).integers(3, 96, size=100).tolist()
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False, prefill_chunk=32) as e:
        chunk = 2 * e.args.num_hidden_layers * e.args.num_key_value_heads * e.args.head_dim * 16 * 4
        answers = []
        for batched in (False, True):
            with mlx_flash.Service(e, directory=str(tmp_path / str(batched)), kv_budget=12 * chunk,
                                   kv_compression="static:4") as svc:  # fmt: skip
                ctx = svc.new_context()
                if not batched:
                    answers.append([s.token for s in svc.call(ctx, e.tokenizer.decode(prompt), max_tokens=8)])
                    continue
                batch = RunningBatch(svc)
                call, _ = batch.start(ctx, e.tokenizer.decode(prompt), max_tokens=8)
                got = []
                while batch.calls:
                    for c, step in batch.step():
                        assert step is not None, c.error
                        got.append(step.token)
                answers.append(got)
    assert answers[0] == answers[1] and len(answers[0]) == 8
