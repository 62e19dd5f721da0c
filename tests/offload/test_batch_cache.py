"""BatchKV (rows of different lengths as one batch: right-padded keys, a per-row mask and per-row
positions; BlockKV and the spilled SpilledKV alike) against references built by hand, a tiny random
llama run batched against each row alone, and the 4-bit per-sequence KV (QuantizedKV): round-trip error and size."""

import os

import numpy as np
import pytest

import mlx_flash
from mlx_flash.backends import get_backend
from mlx_flash.memory.process_plan import ModelShape
from mlx_flash.batching.batch_cache import BatchKV, BlockKV, batch_caches
from mlx_flash.batching.prompts import left_padded, ragged_rows
from mlx_flash.models.cache import KVCache
from mlx_flash.offload.cost_model import kv_bytes
from mlx_flash.offload.kv_spill import SpilledKV, SpillFolder
from mlx_flash.offload.quantized_kv import QuantizedKV, make_row_caches
from mlx_flash.batching.schedule import MicroBatch, Order, run_block

H, HD = 2, 8
BACKENDS = ["torch", "mlx"]


@pytest.fixture(scope="module", params=BACKENDS)
def ops(request):
    return get_backend(request.param)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def filled(ops, rng, lengths, capacity=None):
    """One KVCache per row, row b holding lengths[b] random tokens; and their numpy keys/values."""
    rows, held = [], []
    for n in lengths:
        c = KVCache(capacity)
        k, v = rand(rng, 1, H, n, HD), rand(rng, 1, H, n, HD)
        c.update(ops, ops.array(k), ops.array(v))
        rows.append(c)
        held.append((k, v))
    return rows, held


def reference_mask(lengths, T):
    """keep[b, 0, t, j]: row b (lengths[b] tokens after the update) query t sees key j."""
    S = max(lengths)
    keep = np.zeros((len(lengths), 1, T, S), bool)
    for b, n in enumerate(lengths):
        for t in range(T):
            pos = n - T + t  # the query's own position
            for j in range(S):
                keep[b, 0, t, j] = j <= pos
    return keep


@pytest.fixture
def make(tmp_path):
    """make(kind, ops, rows, room): a batch cache of `kind` over the rows: BatchKV (each row its own
    cache), BlockKV (one buffer) or SpilledKV (each row in a file on flash)."""
    with SpillFolder(str(tmp_path)) as folder:

        def build(kind, ops, rows, room=64):
            if kind == "BatchKV":
                return BatchKV(rows)
            if kind == "BlockKV":
                return BlockKV(ops, rows, room)
            return spilled(ops, folder, rows, room)

        yield build
    assert not os.listdir(tmp_path)  # the folder and its files are gone


def spilled(ops, folder, rows, room, layer=0):
    """The rows' held keys and values written into spill files (at `layer`), as one SpilledKV."""
    files = []
    for r in rows:
        k, v = r.state(ops)
        f = folder.file(layer + 1, k.shape[1], k.shape[3], room)
        f.write(layer, 0, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2))
        files.append(f)
    return SpilledKV(folder, files, layer, [r.offset for r in rows])


KINDS = ["BatchKV", "BlockKV", "SpilledKV"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 3])
def test_update_returns_right_padded_keys_and_values(ops, make, kind, T):
    rng = np.random.default_rng(0)
    lengths = [3, 7, 5, 1]
    rows, held = filled(ops, rng, lengths)
    b = make(kind, ops, rows)
    assert b.offset == 7
    np.testing.assert_array_equal(b.positions(), np.array(lengths))  # before the step: each row's own offset
    assert b.positions().dtype == np.int64
    k, v = rand(rng, 4, H, T, HD), rand(rng, 4, H, T, HD)
    if T > 1:
        b.prefetch()  # a spilled cache reads its rows ahead; the update takes what was read
    keys, values = b.update(ops, ops.array(k), ops.array(v))
    keys, values = ops.to_numpy(keys), ops.to_numpy(values)
    S = max(lengths) + T
    assert keys.shape == values.shape == (4, H, S, HD)
    for r, n in enumerate(lengths):
        want_k = np.concatenate([held[r][0][0], k[r]], axis=1)  # [H, n + T, HD]: its old keys, then its new ones
        want_v = np.concatenate([held[r][1][0], v[r]], axis=1)
        np.testing.assert_array_equal(keys[r, :, : n + T], want_k)
        np.testing.assert_array_equal(values[r, :, : n + T], want_v)
        assert not keys[r, :, n + T :].any() and not values[r, :, n + T :].any()  # the padding is zeros
        if kind == "BatchKV":  # each row's own cache took only its own tokens
            assert rows[r].offset == n + T
            np.testing.assert_array_equal(rows[r].state(ops)[0][0], want_k)
    np.testing.assert_array_equal(b.positions(), np.array(lengths) + T)
    assert b.offset == max(lengths) + T


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 2, 4])
def test_mask_equals_the_reference(ops, make, kind, T):
    rng = np.random.default_rng(1)
    lengths = [6, 2, 9, 9]
    b = make(kind, ops, filled(ops, rng, lengths)[0])
    b.update(ops, ops.array(rand(rng, 4, H, T, HD)), ops.array(rand(rng, 4, H, T, HD)))
    got = b.mask(ops, T).keep(T, max(lengths) + T)  # a RowsMask: each row's length and first position
    want = reference_mask([n + T for n in lengths], T)
    assert got.shape == want.shape == (4, 1, T, max(lengths) + T)
    np.testing.assert_array_equal(got, want)
    # every query sees itself and at least one key; no row sees past its own length
    assert got.any(axis=-1).all()


@pytest.mark.parametrize("kind", KINDS)
def test_rows_of_one_length_need_no_mask(ops, make, kind):
    rng = np.random.default_rng(2)
    for T, want in ((1, None), (3, "causal")):
        b = make(kind, ops, filled(ops, rng, [4, 4, 4])[0])
        b.update(ops, ops.array(rand(rng, 3, H, T, HD)), ops.array(rand(rng, 3, H, T, HD)))
        assert b.mask(ops, T) == want  # as one sequence: no padding to hide


@pytest.mark.parametrize("kind", KINDS)
def test_keep_drops_rows_that_leave(ops, make, kind):
    """A row that finishes leaves; the others keep their keys, positions and mask."""
    rng = np.random.default_rng(9)
    lengths = [4, 9, 2, 6]
    rows, held = filled(ops, rng, lengths)
    b = make(kind, ops, rows)
    k, v = rand(rng, 4, H, 1, HD), rand(rng, 4, H, 1, HD)
    b.update(ops, ops.array(k), ops.array(v))
    b.prefetch()  # a read ahead of rows that then leave is not used
    b.keep(ops, [3, 1])  # rows 0 and 2 finished; the order given is the new order
    np.testing.assert_array_equal(b.positions(), [7, 10])
    k2, v2 = rand(rng, 2, H, 1, HD), rand(rng, 2, H, 1, HD)
    keys, values = b.update(ops, ops.array(k2), ops.array(v2))
    keys = ops.to_numpy(keys)
    assert keys.shape == (2, H, 11, HD)
    for new, old in ((0, 3), (1, 1)):
        n = lengths[old]
        want = np.concatenate([held[old][0][0], k[old], k2[new]], axis=1)
        np.testing.assert_array_equal(keys[new, :, : n + 2], want)
    np.testing.assert_array_equal(b.mask(ops, 1).keep(1, 11), reference_mask([8, 11], 1))


def test_one_row_is_that_rows_cache(ops):
    rng = np.random.default_rng(3)
    rows, held = filled(ops, rng, [5])
    k, v = rand(rng, 1, H, 2, HD), rand(rng, 1, H, 2, HD)
    keys, _ = BatchKV(rows).update(ops, ops.array(k), ops.array(v))
    np.testing.assert_array_equal(ops.to_numpy(keys), np.concatenate([held[0][0], k], axis=2))


def test_trim_capacity_state_and_batch_caches(ops):
    rng = np.random.default_rng(4)
    rows, _ = filled(ops, rng, [3, 6])
    rows[0].capacity = 40
    rows[1].capacity = 24
    b = BatchKV(rows)
    assert b.capacity == 24
    b.trim(2)
    assert [r.offset for r in rows] == [1, 4]
    with pytest.raises(NotImplementedError):
        b.state(ops)
    with pytest.raises(ValueError):
        BatchKV([])
    per_seq = [[KVCache() for _ in range(3)] for _ in range(2)]
    layers = batch_caches(per_seq)
    assert len(layers) == 3
    for i, bk in enumerate(layers):
        assert bk.rows == [per_seq[0][i], per_seq[1][i]]


def test_spilled_kv_holds_its_capacity_and_reads_back_its_state(ops, tmp_path):
    rng = np.random.default_rng(11)
    rows, held = filled(ops, rng, [5])
    with SpillFolder(str(tmp_path)) as folder:
        b = spilled(ops, folder, rows, 8, layer=1)
        assert b.capacity == 8 and b.offset == 5 and b.positions() == 5  # one row: an int, as one sequence
        k, v = b.state(ops)
        np.testing.assert_array_equal(k, held[0][0])
        np.testing.assert_array_equal(v, held[0][1])
        b.update(ops, ops.array(rand(rng, 1, H, 3, HD)), ops.array(rand(rng, 1, H, 3, HD)))
        with pytest.raises(ValueError):
            b.update(ops, ops.array(rand(rng, 1, H, 1, HD)), ops.array(rand(rng, 1, H, 1, HD)))
        b.trim(2)
        assert b.offset == 6
        with pytest.raises(ValueError):
            SpilledKV(folder, [], 0, [])
    assert not os.listdir(tmp_path)


def test_block_kv_holds_its_capacity_and_no_more(ops):
    rng = np.random.default_rng(10)
    rows, _ = filled(ops, rng, [3, 6])
    with pytest.raises(ValueError):
        BlockKV(ops, rows, 5)  # below a row's tokens
    with pytest.raises(ValueError):
        BlockKV(ops, [], 8)
    b = BlockKV(ops, rows, 8)
    assert b.capacity == 8 and b.offset == 6
    b.update(ops, ops.array(rand(rng, 2, H, 2, HD)), ops.array(rand(rng, 2, H, 2, HD)))
    with pytest.raises(ValueError):
        b.update(ops, ops.array(rand(rng, 2, H, 1, HD)), ops.array(rand(rng, 2, H, 1, HD)))
    b.trim(1)
    np.testing.assert_array_equal(b.positions(), [4, 7])
    with pytest.raises(NotImplementedError):
        b.state(ops)
    assert [r.offset for r in rows] == [3, 6]  # the rows were copied, not written


# ---- a tiny random model, batched against each row alone --------------------------------------------


@pytest.fixture(params=BACKENDS)
def tiny(request, tiny_store):
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend=request.param, ffn="resident", progress=False) as e:
        yield e


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 96, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("kind,kv_bits", [("BatchKV", 0), ("BatchKV", 4), ("BlockKV", 0), ("SpilledKV", 0)])
def test_batched_rows_give_each_rows_logits_alone(tiny, tmp_path, kind, kv_bits):
    """Rows of 1..30 tokens decoded as one batch (exact rows in one BlockKV buffer or in files on
    flash, or each row in its own cache, exact or 4-bit), with a multi-token step and two rows leaving
    part way: each row's logits are those of the same row run alone with the same kind of cache."""
    e = tiny
    lengths = [3, 17, 9, 30, 1]
    prompts = prompts_of(lengths)
    rng = np.random.default_rng(5)
    batched = [make_row_caches(e, kv_bits, 64) for _ in prompts]
    single = [make_row_caches(e, kv_bits, 64) for _ in prompts]
    for ids, cb, cs in zip(prompts, batched, single):  # each prompt prefilled alone, twice
        np.testing.assert_array_equal(e.forward(ids, cb), e.forward(ids, cs))
    L = e.args.num_hidden_layers
    folder = SpillFolder(str(tmp_path))
    block = None
    if kind == "BlockKV":
        block = [BlockKV(e.ops, [c[i] for c in batched], 64) for i in range(L)]
    elif kind == "SpilledKV":
        block = [spilled(e.ops, folder, [c[i] for c in batched], 64, layer=i) for i in range(L)]
    live = list(range(len(prompts)))
    for n, T in enumerate((1, 1, 3, 1, 1)):  # decode steps, a three-token step, and decode again
        if n == 3:  # rows 0 and 3 finish and leave the batch
            live = [1, 2, 4]
            if block:
                for c in block:
                    c.keep(e.ops, [1, 2, 4])
        caches = block or batch_caches([batched[r] for r in live])
        assert caches[0].positions().tolist() == [single[r][0].offset for r in live]
        step = rng.integers(3, 96, size=(len(live), T)).tolist()
        [logits] = run_block(e, [MicroBatch(e.ops.tokens(step), caches, all_logits=True)], Order.ZIGZAG)
        assert logits.shape == (len(live), T, 96)
        for b, r in enumerate(live):
            ref = e.forward(step[b], single[r], all_logits=True)
            np.testing.assert_allclose(logits[b], ref, atol=1e-4, rtol=0)
    assert [single[r][0].offset for r in live] == [lengths[r] + 7 for r in live]
    folder.close()


@pytest.mark.parametrize("order", list(Order))
def test_micro_batches_in_either_order_give_each_rows_logits(tiny, order):
    e = tiny
    lengths = [4, 11, 2, 23, 7, 15]
    prompts = prompts_of(lengths, seed=1)
    batched = [make_row_caches(e, 0, 64) for _ in prompts]
    single = [make_row_caches(e, 0, 64) for _ in prompts]
    for ids, cb, cs in zip(prompts, batched, single):
        e.forward(ids, cb)
        e.forward(ids, cs)
    nxt = [[int(t)] for t in np.random.default_rng(6).integers(3, 96, size=len(lengths))]
    groups = [[0, 1, 2], [3, 4], [5]]  # three micro-batches of a block
    mbs = [MicroBatch(e.ops.tokens([nxt[r] for r in g]), batch_caches([batched[r] for r in g])) for g in groups]
    outs = run_block(e, mbs, order)
    for g, logits in zip(groups, outs):
        assert logits.shape == (len(g), 1, 96)
        for b, r in enumerate(g):
            np.testing.assert_allclose(logits[b, -1], e.forward(nxt[r], single[r])[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_bits", [0, 4])
def test_chunks_of_different_lengths_in_one_left_padded_pass_give_each_rows_logits_alone(tiny, kv_bits):
    """Prompt chunks of 1..12 tokens after 0..9 held tokens, one left-padded pass (batch_caches with
    new_tokens): each row's logits at its own tokens, and the KV it keeps, are those of the row alone;
    the padding leaves nothing in a row's cache."""
    e = tiny
    held = [0, 9, 4, 0, 2]
    chunks = prompts_of([5, 12, 1, 7, 12], seed=3)
    batched = [make_row_caches(e, kv_bits, 64) for _ in held]
    single = [make_row_caches(e, kv_bits, 64) for _ in held]
    for ids, cb, cs in zip(prompts_of(held, seed=4), batched, single):
        if ids:
            e.forward(ids, cb)
            e.forward(ids, cs)
    widths = [len(c) for c in chunks]
    caches = batch_caches(batched, widths)
    assert caches[0].positions().tolist() == [h - (12 - w) for h, w in zip(held, widths)]
    [logits] = run_block(e, [MicroBatch(e.ops.tokens(left_padded(chunks)), caches, all_logits=True)], Order.ZIGZAG)
    for b, ids in enumerate(chunks):
        ref = e.forward(ids, single[b], all_logits=True)
        np.testing.assert_allclose(logits[b, 12 - len(ids) :], ref, atol=1e-4, rtol=0)
        assert batched[b][0].offset == held[b] + len(ids)
        if not kv_bits:
            for mine, theirs in zip(batched[b][0].state(e.ops), single[b][0].state(e.ops)):
                np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="a step of 3 tokens"):  # the step must be as wide as its widest row
        run_block(e, [MicroBatch(e.ops.tokens([[5, 6, 7]] * 5), batch_caches(batched, widths))], Order.ZIGZAG)


def test_ragged_rows_pack_chunks_longest_first_within_the_budget():
    assert ragged_rows([128] * 5, 512) == [[(0, 128), (1, 128), (2, 128), (3, 128)], [(4, 128)]]
    assert ragged_rows([700, 30, 200, 100], 512) == [[(0, 512)], [(2, 200), (3, 100)], [(1, 30)]]
    assert ragged_rows([3], 1) == [[(0, 1)]]
    with pytest.raises(ValueError, match="at least one token"):
        ragged_rows([3], 0)
    assert left_padded([[1, 2, 3], [7]]) == [[1, 2, 3], [7, 7, 7]]


# ---- QuantizedKV -------------------------------------------------------------------------------------


def test_quantized_kv_round_trip_error_is_small(ops):
    rng = np.random.default_rng(7)
    heads, hd, cap = 3, 64, 96
    q = QuantizedKV(cap, heads, hd, bits=4)
    ks, vs = [], []
    for T in (10, 1, 1, 21, 7, 1):  # prefill, then decode steps and chunks, crossing block boundaries
        k = rand(rng, 1, heads, T, hd) * 2 + 0.5
        v = rand(rng, 1, heads, T, hd)
        keys, values = q.update(ops, ops.array(k), ops.array(v))
        ks.append(k)
        vs.append(v)
        want_k, want_v = np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)
        keys, values = ops.to_numpy(keys), ops.to_numpy(values)
        assert keys.shape == values.shape == want_k.shape == (1, heads, q.offset, hd)
        for got, want in ((keys, want_k), (values, want_v)):
            err = np.abs(got - want)
            span = float(want.max() - want.min())
            # 4 bits: 15 steps across a group's range, half a step at most, plus float16 scale rounding
            assert err.max() < span / 15, (err.max(), span)
            assert err.mean() < span / 60
    assert q.offset == 41
    sk, sv = q.state(ops)
    np.testing.assert_array_equal(sk, keys)
    np.testing.assert_array_equal(sv, values)
    with pytest.raises(ValueError):
        q.update(ops, ops.array(rand(rng, 1, heads, cap, hd)), ops.array(rand(rng, 1, heads, cap, hd)))
    with pytest.raises(ValueError):
        q.update(ops, ops.array(rand(rng, 2, heads, 1, hd)), ops.array(rand(rng, 2, heads, 1, hd)))


@pytest.mark.parametrize("start,drop", [(41, 9), (32, 1), (20, 4)])
def test_quantized_kv_trim_then_update_equals_the_tokens_fed_directly(ops, start, drop):
    """Forgetting tokens of the unquantized tail (a rejected draft) and writing others holds what a
    cache fed the kept and new tokens holds; forgetting into a quantized block is refused."""
    rng = np.random.default_rng(8)
    heads, hd = 2, 64
    k, v = rand(rng, 1, heads, start, hd), rand(rng, 1, heads, start, hd)
    nk, nv = rand(rng, 1, heads, 5, hd), rand(rng, 1, heads, 5, hd)
    a, b = QuantizedKV(64, heads, hd), QuantizedKV(64, heads, hd)
    a.update(ops, ops.array(k), ops.array(v))
    a.trim(drop)
    assert a.offset == start - drop
    a.update(ops, ops.array(nk), ops.array(nv))
    b.update(ops, ops.array(k[:, :, : start - drop]), ops.array(v[:, :, : start - drop]))
    b.update(ops, ops.array(nk), ops.array(nv))
    for x, y in zip(a.state(ops), b.state(ops)):
        np.testing.assert_array_equal(x, y)
    c = QuantizedKV(64, heads, hd)
    c.update(ops, ops.array(k), ops.array(v))
    with pytest.raises(ValueError):
        c.trim(start - (start - 1) // 16 * 16 + 1)  # back into a block quantized before the last one


def test_quantized_kv_is_under_a_fifth_of_float32():
    heads, hd, cap = 3, 64, 512
    q = QuantizedKV(cap, heads, hd, bits=4)
    f32 = 2 * heads * cap * hd * 4
    assert q.nbytes < f32 / 5, (q.nbytes, f32)


def test_the_cost_model_does_not_underestimate_4_bit_kv():
    """cost_model.kv_bytes plans the batch's memory: what QuantizedKV really allocates must not exceed it."""
    shape = ModelShape(layers=30, d_model=576, heads=9, kv_heads=3, head_dim=64, ffn_width=1536, vocab=49152)
    for tokens in (160, 512, 2048):
        held = shape.layers * QuantizedKV(tokens, shape.kv_heads, shape.head_dim, 4).nbytes
        planned = kv_bytes(shape, tokens, 4)
        assert held <= planned * 1.02, (tokens, held, planned)


def test_make_row_caches(tiny):
    e = tiny
    exact = make_row_caches(e, 0, 50)
    quant = make_row_caches(e, 4, 50)
    assert len(exact) == len(quant) == e.args.num_hidden_layers
    assert all(isinstance(c, KVCache) and c.capacity == 50 for c in exact)
    assert all(isinstance(c, QuantizedKV) and c.capacity == 50 for c in quant)


def test_a_killed_runs_spill_folder_is_removed_by_the_next_run_and_a_live_one_is_kept(tmp_path):
    """A run killed before its end leaves its folder with a free lock: the next SpillFolder under the
    same parent removes it; a live run's folder (its lock held) stays."""
    import subprocess
    import sys

    hold = (
        "import sys, time\nfrom mlx_flash.offload.kv_spill import SpillFolder\n"
        "f = SpillFolder(sys.argv[1]); open(f.path + '/seq-000000.kv', 'wb').write(b'x' * 4096)\n"
        "print(f.path, flush=True); time.sleep(60)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        killed, live = (p.stdout.readline().strip() for p in procs)
        procs[0].kill()
        procs[0].wait()
        assert os.path.isdir(killed)  # nothing ran at its end
        with SpillFolder(str(tmp_path)) as folder:
            assert not os.path.exists(killed) and os.path.isdir(live) and os.path.isdir(folder.path)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_folder_being_made_is_never_taken_for_a_killed_runs(tmp_path, monkeypatch):
    """Another run reaping orphans at the worst moment, between a folder's creation and its lock being
    taken, must not find that folder's lock free and remove it: the lock only takes its name once held."""
    import fcntl

    from mlx_flash.offload import kv_spill

    real, reaped = fcntl.flock, []

    def reap_first(fh, op):
        if op == fcntl.LOCK_EX and not reaped:  # this run's lock, about to be taken
            reaped.append(kv_spill.reap_orphans(str(tmp_path)))  # (its own flocks are LOCK_NB: not here)
        return real(fh, op)

    monkeypatch.setattr(kv_spill.fcntl, "flock", reap_first)
    with SpillFolder(str(tmp_path)) as folder:
        assert reaped == [[]] and os.path.isdir(folder.path)
