"""ChunkedBatchKV (the server's decode batch over contexts in one chunk pool: one scatter per layer
and step, attention over every row's chunks where they lie through a slot table) against BatchKV
over the same kind of rows (each row gathered, padded, masked): a tiny random llama, rows of
different lengths in non-consecutive slots, decode steps with rows leaving: the logits and every
row's held KV agree to float32 rounding on both backends (two attention kernels, summing in another
order), and each row's attention in the batch equals its own attention alone bit for bit (one kernel)."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.batching.batch_cache import batch_caches
from mlx_flash.batching.schedule import MicroBatch, Order, run_block
from mlx_flash.service.chunk_pool import ChunkPool, ChunkShape
from mlx_flash.service.chunked_kv import ChunkedBatchKV, ChunkTable, chunked_batch_caches
from mlx_flash.service.running_batch import RunningBatch


@pytest.fixture(params=["torch", "mlx"])
def tiny(request, tiny_store):
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend=request.param, ffn="resident", progress=False) as e:
        yield e


def contexts(e, lengths, seed):
    """One pool; a table per row prefilled alone with its prompt, its slots interleaved with others'."""
    a = e.args
    pool = ChunkPool(e.ops, ChunkShape(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 8), 40)
    tables = [ChunkTable(pool) for _ in lengths]
    rng = np.random.default_rng(seed)
    for n, t in zip(lengths, tables):
        pool.allocate()  # a gap: each table's slots are not consecutive with the last one's
        caches = t.caches()
        e.forward(rng.integers(3, 96, size=n).tolist(), caches)
        t.tokens = caches[0].offset
    return pool, tables


def test_attention_where_the_rows_lie_equals_a_gather_per_row(tiny):
    e = tiny
    lengths = [5, 19, 1, 12]
    _, ta = contexts(e, lengths, seed=0)
    _, tb = contexts(e, lengths, seed=0)
    ca, cb = [t.caches() for t in ta], [t.caches() for t in tb]
    rng = np.random.default_rng(1)
    live = list(range(len(lengths)))
    for step in range(6):
        if step == 3:
            live = [1, 3]  # rows 0 and 2 leave
        tokens = rng.integers(3, 96, size=(len(live), 1)).tolist()
        fast = chunked_batch_caches([ca[r] for r in live])
        assert isinstance(fast[0], ChunkedBatchKV)
        assert fast[0].positions().tolist() == [ca[r][0].offset for r in live]
        got = run_block(e, [MicroBatch(e.ops.tokens(tokens), fast)], Order.ZIGZAG)[0]
        want = run_block(e, [MicroBatch(e.ops.tokens(tokens), batch_caches([cb[r] for r in live]))], Order.ZIGZAG)[0]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for r in range(len(lengths)):
        for layer in (0, e.args.num_hidden_layers - 1):
            for x, y in zip(ca[r][layer].state(e.ops), cb[r][layer].state(e.ops)):
                np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
        assert ca[r][0].offset == lengths[r] + (6 if r in (1, 3) else 3)


def test_a_row_attends_in_the_batch_as_it_does_alone(tiny):
    """One layer: the batch's update writes every row's new key, its attention reads each row's
    chunks through the step's slot table; each row's ChunkedKV then attends alone over the same pool
    to the same bits. A mask the graph combined with the batch's own (Gemma 3's sliding window) goes
    through the gathered keys instead, to the same numbers up to rounding."""
    e, ops = tiny, tiny.ops
    a = e.args
    _, tables = contexts(e, [5, 19, 1, 12], seed=4)
    rows = [t.caches()[0] for t in tables]
    B, H, Hq, hd = len(rows), a.num_key_value_heads, a.num_attention_heads, a.head_dim
    rng = np.random.default_rng(5)
    k, v = (ops.array(rng.standard_normal((B, H, 1, hd)).astype(np.float32)) for _ in range(2))
    q = rng.standard_normal((B, Hq, 1, hd)).astype(np.float32)
    batch = ChunkedBatchKV(rows)
    keys, values = batch.update(ops, k, v)
    assert keys.shape == (B, H, 20, hd)
    mask = batch.mask(ops, 1)
    got = ops.to_numpy(batch.attention(ops, ops.array(q), keys, values, 0.25, mask))
    for b, r in enumerate(rows):
        alone = ops.to_numpy(r.attention(ops, ops.array(q[b : b + 1]), None, None, 0.25, None))
        np.testing.assert_array_equal(got[b : b + 1], alone)
    combined = ops.mask(mask.keep(1, 20))  # equal to the batch's, but not its own
    gathered = ops.to_numpy(batch.attention(ops, ops.array(q), keys, values, 0.25, combined))
    np.testing.assert_allclose(gathered, got, atol=1e-5, rtol=1e-5)


def test_rows_of_another_pool_or_layer_are_refused(tiny):
    e = tiny
    _, ta = contexts(e, [3, 4], seed=2)
    _, tb = contexts(e, [3], seed=2)
    with pytest.raises(ValueError):
        ChunkedBatchKV([ta[0].caches()[0], tb[0].caches()[0]])
    with pytest.raises(ValueError):
        ChunkedBatchKV([ta[0].caches()[0], ta[1].caches()[1]])
    with pytest.raises(ValueError):
        ChunkedBatchKV([])


def test_running_batch_prefills_prompts_together_and_decodes_while_a_long_one_prefills(tiny_store, tmp_path):
    """The server's batch: a decoding call, then a long prompt (3 chunks of 16) and two short ones
    join; each step decodes the first call and runs one pass of prompt chunks: the short prompts go
    first, packed into one pass, the long one in three more, the decoding call gets a token every
    step meanwhile, and every call's greedy tokens equal the same call run alone through Service.call."""
    store, _ = tiny_store("llama")
    rng = np.random.default_rng(3)
    texts = [rng.integers(3, 96, size=n).tolist() for n in (6, 37, 3, 5)]
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False, prefill_chunk=16) as e:
        prompts = [e.tokenizer.decode(t) for t in texts]
        alone = []
        with mlx_flash.Service(e, directory=str(tmp_path / "alone"), kv_budget="4MB") as svc:
            for p in prompts:
                alone.append([s.token for s in svc.call(svc.new_context(), p, max_tokens=12)])
        with mlx_flash.Service(e, directory=str(tmp_path / "batch"), kv_budget="4MB") as svc:
            batch = RunningBatch(svc)
            calls = [batch.start(svc.new_context(), prompts[0], max_tokens=12)[0]]
            assert len(calls[0].ids) <= 16
            [(c, step)] = batch.step()  # its one-chunk prompt: its first token
            got, first = {id(c): [step.token]}, {}
            for p in prompts[1:]:
                calls.append(batch.start(svc.new_context(), p, max_tokens=12)[0])
                got[id(calls[-1])] = []
            assert 32 < len(calls[1].ids) <= 48 and len(calls[2].ids) + len(calls[3].ids) <= 16
            n = 0
            while batch.calls:
                live = calls[0] in batch.calls
                out = batch.step()
                n += 1
                assert not live or any(c is calls[0] for c, _ in out)  # it decodes in every step
                for c, step in out:
                    first.setdefault(id(c), n)
                    got[id(c)].append(step.token)
            assert first[id(calls[2])] == first[id(calls[3])] == 1  # the short ones, together, first
            assert first[id(calls[1])] == 4  # then the long one's three chunks
            assert [got[id(c)] for c in calls] == alone
