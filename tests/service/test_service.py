"""The service on the real default model: a context called in turns equals one engine run over the
whole conversation; chunked KV equals the contiguous cache bit for bit; swapped contexts come back
exact by reading, and with the same greedy tokens by recomputing; eviction, forks and scoping."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.errors import ConfigError, ContextNotFoundError, MemoryBudgetError
from mlx_flash.service.chunk_pool import ChunkPool, ChunkShape
from mlx_flash.service.chunked_kv import ChunkTable
from mlx_flash.service.lifecycle import Restore

TURNS = ["What is the capital of France?", "And of Germany?", "Name a river that flows through it."]
pytestmark = pytest.mark.slow


def user(text):
    return [{"role": "user", "content": text}]


def answer(svc, ctx, text, **kw):
    return "".join(s.text for s in svc.call(ctx, user(text), max_tokens=kw.pop("max_tokens", 20), **kw))


@pytest.fixture(params=["mlx", "torch"])
def engine(request, engines, store_dir):
    return engines(store_dir, request.param)


def test_three_turns_equal_one_run_over_the_conversation(engine, tmp_path):
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget="40MB")
    ctx = svc.new_context()
    for t in TURNS:
        answer(svc, ctx, t)
    msgs = svc.get(ctx).messages
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 3
    assert svc.last.cached_tokens > 0
    # The third answer equals one fresh engine run over the whole conversation.
    ref = engine.generate(msgs[:-1], max_tokens=20)
    assert ref == msgs[-1]["content"]
    # Logits: the context's KV fed in turns against one prefill of every held token.
    c = svc.get(ctx)
    ids = c.held()
    step = [1234]
    seg = engine.forward(step, c.table.caches(), all_logits=True)
    full = engine.logits(ids + step)[-1:]
    diff = float(np.abs(seg - full).max())
    print(f"{engine.ops.name}: max |logit difference| turns vs one prefill = {diff:.2e}")
    assert diff < 1e-3
    svc.close()


def test_chunked_kv_equals_contiguous_cache_bit_for_bit(engine):
    a = engine.args
    pool = ChunkPool(engine.ops, ChunkShape(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 16), 12)
    pool.allocate(), pool.allocate()  # the sequence's slots start later and out of order
    table = ChunkTable(pool)
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    assert len(ids) > 80
    ref = engine.new_caches()
    scrambled = False
    for seg in (ids[:7], ids[7:30], ids[30:31], ids[31:64], ids[64:]):
        caches = table.caches()
        out = engine.forward(seg, caches, all_logits=True)
        table.tokens = caches[0].offset
        if not scrambled:  # make the next chunks non-consecutive: the gathered path
            pool.allocate()
            scrambled = True
        assert np.array_equal(out, engine.forward(seg, ref, all_logits=True))
    assert table.slots != sorted(table.slots) or np.diff(table.slots).max() > 1
    for layer in (0, a.num_hidden_layers - 1):
        k1, v1 = ref[layer].state(engine.ops)
        k2, v2 = table.caches()[layer].state(engine.ops)
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2)


def test_rows_are_a_slice_only_when_every_row_follows_the_last():
    ops = mlx_flash.backends.get_backend("mlx")
    pool = ChunkPool(ops, ChunkShape(1, 1, 4, 16), 12)
    t = ChunkTable(pool)
    t.slots = [0, 10, 2]  # the ends are 35 rows apart, as a run of 35 would be, but slot 1 is not ours
    got = np.asarray(t.rows(0, 35))
    assert got.tolist() == list(range(16)) + list(range(160, 176)) + [32, 33, 34]
    t.slots = [3, 4, 5]
    assert t.rows(5, 40) == slice(53, 88)


def test_allocator_frees_and_refuses():
    ops = mlx_flash.backends.get_backend("mlx")
    pool = ChunkPool(ops, ChunkShape(2, 1, 4, 4), 3)
    s = [pool.allocate() for _ in range(3)]
    assert not pool.can_allocate() and sorted(s) == [0, 1, 2]
    with pytest.raises(MemoryBudgetError, match="3 KV chunk slots"):
        pool.allocate()
    pool.share(s[0])
    assert not pool.release(s[0]) and pool.release(s[0]) and pool.can_allocate(1)
    with pytest.raises(ValueError):
        pool.release(s[0])
    with pytest.raises(MemoryBudgetError):
        ChunkPool(ops, ChunkShape(2, 1, 4, 4), 0)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_a_growing_pool_holds_what_its_slots_need_and_keeps_their_rows(backend):
    ops = mlx_flash.backends.get_backend(backend)
    shape = ChunkShape(2, 1, 4, 4)
    slot_bytes = 2 * 2 * 4 * 4 * ops.array(np.zeros(1, np.float32)).nbytes  # layers, keys and values, C, hd
    pool = ChunkPool(ops, shape, 16, grows=True)
    assert pool.held_slots == 1 and pool.nbytes == slot_bytes
    data = np.random.default_rng(0).standard_normal((3,) + shape.array_shape).astype(np.float32)
    held = []
    for i in range(16):
        with ops.inference():  # a pool grows inside model calls; swapped chunks are read back outside them
            slot = pool.allocate()
        if i < 3:
            pool.load([slot], data[i : i + 1])
        held.append(pool.held_slots)
    # doubling from one slot, then straight to all 16 once past a quarter of them
    assert held == [1, 2, 4, 4] + [16] * 12
    assert np.array_equal(pool.export([0, 1, 2]), data)  # rows written before each growth kept
    assert not pool.can_allocate()
    whole = ChunkPool(ops, shape, 16)
    assert whole.held_slots == 16 and whole.nbytes == 16 * slot_bytes == pool.nbytes


def test_swapped_context_restores_exact_by_reading_and_same_tokens_by_recompute(engines, store_dir, tmp_path):
    engine = engines(store_dir, "torch")
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget="40MB")
    ctx = svc.new_context()
    for t in TURNS[:2]:
        answer(svc, ctx, t)
    c = svc.get(ctx)
    before = [x.state(engine.ops) for x in c.table.caches()]
    n = c.kv_tokens
    svc.swap_out(ctx)
    assert not c.chunks_in_memory()
    report = svc.bring_back(ctx, Restore.READ)
    assert report.chunks_read == len(c.table.slots) and report.chunks_recomputed == 0 and c.kv_tokens == n
    after = [x.state(engine.ops) for x in c.table.caches()]
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(before, after))
    svc.swap_out(ctx)
    report = svc.bring_back(ctx, Restore.RECOMPUTE)
    assert report.chunks_recomputed == len(c.table.slots) and report.chunks_read == 0
    again = [x.state(engine.ops) for x in c.table.caches()]
    diff = max(float(np.abs(a[0] - b[0]).max()) for a, b in zip(before, again))
    print(f"recomputed KV: max |difference| {diff:.2e}")
    assert diff < 1e-3
    ref = svc.get(ctx).messages + user(TURNS[2])
    assert answer(svc, ctx, TURNS[2]) == engine.generate(ref, max_tokens=20)
    svc.close()


def test_contexts_beyond_the_budget_swap_and_come_back(engines, store_dir, tmp_path):
    engine = engines(store_dir, "torch")
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget=6 * 737280)  # six chunks
    ids = [svc.new_context() for _ in range(3)]
    first = {c: answer(svc, c, "What is the capital of France?", max_tokens=8) for c in ids}
    assert svc.stats().contexts_swapped >= 1  # three contexts of 3 chunks cannot all stay
    for c in ids:  # each comes back (read, recomputed or both) and continues as a fresh run would
        out = answer(svc, c, "And of Italy?", max_tokens=8)
        ref = engine.generate(
            user("What is the capital of France?")
            + [{"role": "assistant", "content": first[c]}]
            + user("And of Italy?"),
            max_tokens=8,
        )
        assert out == ref
    s = svc.stats()
    assert s.chunks_written > 0 and s.chunks_read + s.chunks_recomputed > 0
    svc.close()


def test_a_context_longer_than_the_budget_is_refused(engines, store_dir, tmp_path):
    engine = engines(store_dir, "torch")
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget=2 * 737280)
    ctx = svc.new_context()
    with pytest.raises(ConfigError, match="a context holds fewer than 32"):
        svc.call(ctx, "word " * 40)
    svc.close()


def test_fork_shares_chunks_copy_on_write(engines, store_dir, tmp_path):
    engine = engines(store_dir, "torch")
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget="40MB")
    a = svc.new_context()
    answer(svc, a, TURNS[0])
    ca = svc.get(a)
    before = [x.state(engine.ops) for x in ca.table.caches()]
    b = svc.fork(a, 20)
    cb = svc.get(b)
    assert cb.table.slots[0] == ca.table.slots[0] and svc.pool.is_shared(ca.table.slots[0])
    # b continues past token 20: its second chunk (shared, partly held) is copied before the write
    list(svc.call(b, " and more words", whole=False, max_tokens=4))
    assert cb.table.slots[1] != ca.table.slots[1]
    after = [x.state(engine.ops) for x in ca.table.caches()]
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(before, after))
    svc.close()


def test_prefix_matching_and_scoping(engines, store_dir, tmp_path):
    engine = engines(store_dir, "torch")
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget="40MB")
    a = svc.new_context(owner="alice")
    answer(svc, a, TURNS[0], owner="alice")
    ids = engine.encode_prompt(svc.get(a, "alice").messages + user(TURNS[1]))
    assert svc.match(ids, "alice") == (a, svc.get(a, "alice").kv_tokens)
    assert svc.match(ids, "bob") == (None, 0)
    with pytest.raises(ContextNotFoundError):
        svc.get(a, "bob")
    with pytest.raises(ContextNotFoundError):
        svc.delete(a, "bob")
    assert [d["id"] for d in svc.list("alice")] == [a] and svc.list("bob") == []
    svc.close()


def test_restart_restores_contexts_with_identical_output(engines, store_dir, tmp_path):
    engine = engines(store_dir, "torch")
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget="40MB")
    ctx = svc.new_context(system="You are a geography teacher.")
    answer(svc, ctx, TURNS[0])
    svc.flush()
    ref = answer(svc, ctx, TURNS[1])
    svc.close()
    # The same state on flash before the second turn: reopen a copy made right after the flush.
    svc2 = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget="40MB")
    assert ctx in svc2.contexts and svc2.problems == []
    c = svc2.get(ctx)
    assert c.messages[-1]["role"] == "assistant"
    out = answer(svc2, ctx, TURNS[2])
    assert svc2.last.restore.chunks_read + svc2.last.restore.chunks_recomputed > 0
    assert svc2.last.cached_tokens > 0
    expect = engine.generate(c.messages[:-1], max_tokens=20)
    assert out == expect and ref
    svc2.close()


# vLLM-SQ (static 8-bit chunks: the LMK path at one width) in the full tier
@pytest.mark.parametrize("name", ["whole-context swap", "LMK", pytest.param("vLLM-SQ", marks=pytest.mark.full)])
def test_baseline_lifecycles_keep_answers(engines, store_dir, tmp_path, name):
    """The benchmark's baselines (whole-context eviction, dropping and recomputing, static 8-bit
    chunks) under a budget that forces their eviction path still answer each call."""
    from mlx_flash.bench.service_trace import VARIANTS

    v = next(x for x in VARIANTS if x.name == name)
    engine = engines(store_dir, "torch")
    svc = mlx_flash.Service(
        engine, directory=str(tmp_path), kv_budget=6 * 737280, lifecycle=v.lifecycle, kv_compression=v.compression
    )
    ids = [svc.new_context() for _ in range(3)]
    for c in ids + ids:
        assert answer(svc, c, "What is the capital of France?", max_tokens=6)
    s = svc.stats()
    assert s.chunks_read + s.chunks_recomputed > 0
    assert (s.chunks_written == 0) == (name == "LMK")
    svc.close()
