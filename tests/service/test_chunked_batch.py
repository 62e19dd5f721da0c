"""ChunkedBatchKV (the server's decode batch over contexts in one chunk pool: one scatter and one
gather per layer and step) against BatchKV over the same kind of rows: a tiny random llama, rows of
different lengths in non-consecutive slots, decode steps with rows leaving: the logits and every
row's held KV are bit for bit the same, on both backends."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.batching.batch_cache import batch_caches
from mlx_flash.batching.schedule import MicroBatch, Order, run_block
from mlx_flash.service.chunk_pool import ChunkPool, ChunkShape
from mlx_flash.service.chunked_kv import ChunkedBatchKV, ChunkTable, chunked_batch_caches


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


def test_one_gather_equals_a_gather_per_row(tiny):
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
        np.testing.assert_array_equal(got, want)
    for r in range(len(lengths)):
        for layer in (0, e.args.num_hidden_layers - 1):
            for x, y in zip(ca[r][layer].state(e.ops), cb[r][layer].state(e.ops)):
                np.testing.assert_array_equal(x, y)
        assert ca[r][0].offset == lengths[r] + (6 if r in (1, 3) else 3)


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
