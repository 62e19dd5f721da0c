"""Throughput mode without a model: the policy's JSON form (what `python -m mlx_flash.batch --policy`
takes), the cost model's monotonicity (overlap, order, resident layers), and the search (an LP per
batch shape) against a hand-built Machine and Workload."""

import itertools
from dataclasses import replace

import pytest

from mlx_flash.errors import ConfigError, MemoryBudgetError
from mlx_flash.memory.process_plan import ModelShape
from mlx_flash.offload import Order, Policy
from mlx_flash.offload.cost_model import (
    ComputeSpeed,
    Machine,
    Workload,
    block_seconds,
    fits,
    kv_bytes,
    memory_bytes,
    minimum_bytes,
    PACKED_PASS,
    prefill_pass,
    run_seconds,
    tokens_per_s,
)
from mlx_flash.offload.search import SIZES, describe, resident_share, search
from mlx_flash.units import fmt

# The default model's shape (SmolLM2-135M) and its FFN layer as stored.
SHAPE = ModelShape(layers=30, d_model=576, heads=9, kv_heads=3, head_dim=64, ffn_width=1536, vocab=49152)
LAYER_BYTES = 1_658_880
SPEED = ComputeSpeed(pre_fixed=2e-4, pre_per_token=3e-5, dec_fixed=4e-4, dec_per_row=2e-5)
WORK = Workload(sequences=64, prompt=100, generate=32)
GB = 1 << 30


def machine(room=GB, read_bps=2e8, layer_bytes=LAYER_BYTES, compute=SPEED, attn=(), weights_room=None):
    return Machine(
        room=room,
        weights_room=room if weights_room is None else weights_room,
        ffn_layer_bytes=layer_bytes,
        n_layers=SHAPE.layers,
        read_bps=read_bps,
        compute=compute,
        shape=SHAPE,
        attn_read_bytes=attn,
    )


# read-bound (a layer read takes ~8 ms, far above a decode step's compute), balanced, compute-bound,
# and read-bound with streamed attention as well
MACHINES = {
    "read-bound": machine(read_bps=2e8),
    "balanced": machine(read_bps=4e9),
    "compute-bound": machine(read_bps=1e12),
    "streamed-attention": machine(read_bps=5e8, attn=tuple([400_000] * SHAPE.layers)),
}
SHAPES = [(1, 1), (1, 8), (4, 4), (8, 1), (8, 8), (32, 2)]


def total(m, w, p):
    return sum(block_seconds(m, w, p))


# ---- Policy and its JSON ---------------------------------------------------------------------------


def test_policy_from_json_reads_every_field():
    p = Policy.from_json(
        '{"gpu_batch": 8, "num_batches": 4, "resident_layers": 3, "kv_bits": 4, "order": "row", "overlap": false}'
    )
    assert p == Policy(8, 4, resident_layers=3, kv_bits=4, order=Order.ROW, overlap=False)
    assert p.block_size == 32


def test_policy_from_json_keeps_defaults_for_fields_left_out():
    assert Policy.from_json('{"gpu_batch": 16}') == Policy(gpu_batch=16)
    assert Policy.from_json("{}") == Policy()
    assert Policy() == Policy(1, 1, 0, 0, Order.ZIGZAG, True)


@pytest.mark.parametrize(
    "p",
    [
        Policy(),
        Policy(32, 1),
        Policy(8, 4, order=Order.ROW),
        Policy(2, 16, resident_layers=7, kv_bits=4, overlap=False),
        Policy(4, 4, kv_on_flash=2, attention_keep=0.25),
    ],
)
def test_policy_round_trips_through_what_it_prints(p):
    assert Policy.from_json(str(p)) == p
    assert p.to_dict()["order"] == p.order.value


@pytest.mark.parametrize(
    "text,words",
    [
        ("{gpu_batch: 8}", "not JSON"),
        ('{"gpu_batch": 8', "not JSON"),
        ("[8, 4]", "expected a JSON object"),
        ('"row"', "expected a JSON object"),
        ('{"gpu_batch": 8, "batch": 4}', "unknown field(s) batch"),
        ('{"gpu_batch": 8, "zz": 1, "aa": 2}', "unknown field(s) aa, zz"),
        ('{"gpu_batch": "8"}', "gpu_batch must be an integer"),
        ('{"num_batches": 4.0}', "num_batches must be an integer"),
        ('{"resident_layers": true}', "resident_layers must be an integer"),
        ('{"kv_bits": null}', "kv_bits must be an integer"),
        ('{"overlap": "yes"}', "overlap must be true or false"),
        ('{"overlap": 1}', "overlap must be true or false"),
        ('{"order": "diagonal"}', "order must be one of ['zigzag', 'row']"),
        ('{"order": ["row"]}', "order must be one of"),
        ('{"order": null}', "order must be one of"),
        ('{"gpu_batch": 0}', "gpu_batch and num_batches must be >= 1"),
        ('{"num_batches": -2}', "gpu_batch and num_batches must be >= 1"),
        ('{"resident_layers": -1}', "resident_layers must be >= 0"),
        ('{"kv_bits": 8}', "kv_bits must be one of (0, 4)"),
        ('{"num_batches": 2, "kv_on_flash": 3}', "kv_on_flash must be in 0..num_batches=2 (got 3)"),
        ('{"kv_on_flash": -1}', "kv_on_flash must be in 0..num_batches=1"),
        ('{"kv_on_flash": 1, "kv_bits": 4}', "kv_on_flash needs kv_bits 0"),
        ('{"attention_keep": 0}', "attention_keep must be in (0, 1] (got 0.0)"),
        ('{"attention_keep": 1.5}', "attention_keep must be in (0, 1]"),
        ('{"attention_keep": "all"}', "attention_keep must be a number"),
        ('{"attention_keep": false}', "attention_keep must be a number"),
    ],
)
def test_bad_policy_json_is_one_config_error_line(text, words):
    with pytest.raises(ConfigError) as e:
        Policy.from_json(text)
    msg = str(e.value)
    assert msg.startswith("policy: ") and words in msg, msg
    assert "\n" not in msg


def test_policy_check_refuses_more_resident_layers_than_the_model_has():
    assert Policy(resident_layers=30).check(30).resident_layers == 30
    with pytest.raises(ConfigError, match=r"resident_layers must be in 0\.\.30 \(got 31\)"):
        Policy(resident_layers=31).check(30)


# ---- cost model --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_overlap_is_never_slower_than_no_overlap(name):
    m = MACHINES[name]
    for (gb, nb), r, order in itertools.product(SHAPES, (0, 10, 30), Order):
        on = Policy(gb, nb, r, order=order, overlap=True)
        off = Policy(gb, nb, r, order=order, overlap=False)
        for a, b in zip(block_seconds(m, WORK, on), block_seconds(m, WORK, off)):
            assert a <= b, (on, off)
        assert tokens_per_s(m, WORK, on) >= tokens_per_s(m, WORK, off)
        assert run_seconds(m, WORK, on) <= run_seconds(m, WORK, off)
        if r < SHAPE.layers or m.attn_read_bytes:  # a read hides behind compute instead of adding to it
            assert total(m, WORK, on) < total(m, WORK, off)
        else:  # nothing read: no difference
            assert total(m, WORK, on) == pytest.approx(total(m, WORK, off))


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_row_order_is_never_faster_than_zigzag_when_layers_are_streamed(name):
    m = MACHINES[name]
    for (gb, nb), r, overlap in itertools.product(SHAPES, (0, 10, 29), (True, False)):
        zz = Policy(gb, nb, r, order=Order.ZIGZAG, overlap=overlap)
        row = Policy(gb, nb, r, order=Order.ROW, overlap=overlap)
        assert total(m, WORK, row) >= total(m, WORK, zz), (zz, row)
        assert tokens_per_s(m, WORK, row) <= tokens_per_s(m, WORK, zz)
    # strictly slower where reads dominate and a block has several micro-batches (each re-reads)
    rb = MACHINES["read-bound"]
    assert total(rb, WORK, Policy(4, 4, order=Order.ROW)) > 2 * total(rb, WORK, Policy(4, 4))
    # all layers resident: nothing is read, the two orders cost the same
    for gb, nb in SHAPES:
        assert total(rb, WORK, Policy(gb, nb, 30, order=Order.ROW)) == pytest.approx(
            total(rb, WORK, Policy(gb, nb, 30))
        )


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_more_resident_layers_are_never_slower(name):
    m = MACHINES[name]
    for (gb, nb), order, overlap in itertools.product(SHAPES, Order, (True, False)):
        times = [total(m, WORK, Policy(gb, nb, r, order=order, overlap=overlap)) for r in range(SHAPE.layers + 1)]
        assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:])), (gb, nb, order, overlap)
        mems = [memory_bytes(m, WORK, Policy(gb, nb, r, order=order, overlap=overlap)) for r in range(SHAPE.layers + 1)]
        assert all(b - a == LAYER_BYTES for a, b in zip(mems, mems[1:]))  # each costs one layer as stored
    if name == "read-bound":  # one sequence's decode waits on reads: holding every layer pays many times over
        assert block_seconds(m, WORK, Policy(1, 1, 30))[1] < block_seconds(m, WORK, Policy(1, 1, 0))[1] / 5


def test_tokens_per_s_and_run_seconds_follow_the_block_time():
    m = MACHINES["balanced"]
    for gb, nb in SHAPES:
        p = Policy(gb, nb, 5)
        pre, dec = block_seconds(m, WORK, p)
        assert pre > 0 and dec > 0
        assert tokens_per_s(m, WORK, p) == pytest.approx(p.block_size * WORK.generate / (pre + dec))
    w = Workload(sequences=64, prompt=100, generate=32)
    assert run_seconds(m, w, Policy(8, 4)) == pytest.approx(2 * total(m, w, Policy(8, 4)))  # two full blocks
    w = Workload(sequences=40, prompt=100, generate=32)  # one full block and 8 sequences more
    assert run_seconds(m, w, Policy(8, 4)) == pytest.approx(total(m, w, Policy(8, 4)) + total(m, w, Policy(8, 1)))


def test_memory_grows_with_the_block_and_4_bit_kv_holds_under_a_fifth():
    m = MACHINES["balanced"]
    assert minimum_bytes(m, WORK) == min(memory_bytes(m, WORK, Policy()), memory_bytes(m, WORK, Policy(kv_on_flash=1)))
    small, big = memory_bytes(m, WORK, Policy(4, 2)), memory_bytes(m, WORK, Policy(4, 8))
    assert big > small
    tokens = 1000
    assert kv_bytes(SHAPE, tokens, 0) == 2 * SHAPE.layers * SHAPE.kv_heads * SHAPE.head_dim * 4 * tokens
    assert kv_bytes(SHAPE, tokens, 4) < kv_bytes(SHAPE, tokens, 0) / 5
    assert memory_bytes(m, WORK, Policy(8, 8, kv_bits=4)) < memory_bytes(m, WORK, Policy(8, 8))


def test_kv_on_flash_trades_memory_for_reads():
    """Each micro-batch whose KV moves to flash frees its KV but for one micro-batch's layer in
    flight, and adds its KV's reads to every layer and step: slower where reads cost, never faster."""
    kv_mb = kv_bytes(SHAPE, 8 * (WORK.prompt + WORK.generate), 0)  # one micro-batch of 8 rows, all layers
    for name, m in MACHINES.items():
        mems = [memory_bytes(m, WORK, Policy(8, 4, kv_on_flash=s)) for s in range(5)]
        assert all(b < a for a, b in zip(mems, mems[1:])), name
        assert mems[0] - mems[4] > 3 * kv_mb  # four micro-batches' KV, less the in-flight buffers
        times = [total(m, WORK, Policy(8, 4, kv_on_flash=s)) for s in range(5)]
        assert all(b >= a for a, b in zip(times, times[1:])), name
    rb = MACHINES["read-bound"]
    assert total(rb, WORK, Policy(8, 4, 30, kv_on_flash=4)) > 1.5 * total(rb, WORK, Policy(8, 4, 30))


def test_search_puts_kv_on_flash_when_reads_are_cheap_and_memory_is_not():
    """Compute-bound and a room too small for a large block's KV: the search keeps the large block and
    moves its KV to flash; with ample room it keeps the KV in memory."""
    w = Workload(sequences=256, prompt=100, generate=32)
    fast = dict(read_bps=1e12, layer_bytes=LAYER_BYTES)
    room = memory_bytes(machine(**fast), w, Policy(32, 8, kv_on_flash=8))
    c = search(machine(room=room, **fast), w)
    assert c.policy.kv_on_flash > 0 and c.memory <= room
    assert not fits(machine(room=room, **fast), w, replace(c.policy, kv_on_flash=0))
    assert search(machine(room=64 * GB, **fast), w).policy.kv_on_flash == 0


# ---- the search --------------------------------------------------------------------------------------


def rooms(m, w):
    need = minimum_bytes(m, w)
    return [need, need + LAYER_BYTES // 2, int(need * 1.5), 3 * need, 20 * need, 64 << 20, 256 << 20, 4 * GB]


# the balanced machine (between the read-bound and compute-bound ones) in the full tier
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.full) if n == "balanced" else n for n in sorted(MACHINES)]
)
def test_search_returns_a_policy_that_fits_the_room(name):
    base = MACHINES[name]
    for room in rooms(base, WORK):
        m = machine(room=room, read_bps=base.read_bps, attn=base.attn_read_bytes)
        for kv in ((0,), (0, 4)):
            c = search(m, WORK, kv)
            p = c.policy
            assert memory_bytes(m, WORK, p) <= room, (room, p)
            assert fits(m, WORK, p)
            assert c.memory == memory_bytes(m, WORK, p)
            assert 0 <= p.resident_layers <= SHAPE.layers and p.kv_bits in kv
            assert p.gpu_batch in SIZES and p.num_batches in SIZES and p.gpu_batch <= WORK.sequences
            assert c.seconds == pytest.approx(run_seconds(m, WORK, p))
            assert c.tokens_per_s == pytest.approx(tokens_per_s(m, WORK, p))
            assert c == describe(m, WORK, p)
            # no worse than the simplest policy that fits (one sequence at a time, nothing resident)
            simplest = Policy() if fits(m, WORK, Policy()) else Policy(kv_on_flash=1)
            assert c.seconds <= run_seconds(m, WORK, simplest)
        # allowing 4-bit KV only adds candidates
        assert search(m, WORK, (0, 4)).seconds <= search(m, WORK, (0,)).seconds


def test_search_at_the_minimum_runs_one_sequence_at_a_time():
    m = machine(room=minimum_bytes(machine(), WORK))
    c = search(m, WORK)
    assert c.policy.block_size == 1 and c.policy.resident_layers == 0
    assert c.memory <= m.room


def test_search_keeps_every_layer_when_reads_dominate_and_memory_is_ample():
    c = search(machine(room=4 * GB, read_bps=2e8), WORK)
    assert c.policy.resident_layers == SHAPE.layers
    assert c.policy.block_size > 1  # batching pays once nothing is read
    # with a tight room, the same machine keeps fewer layers, but still fits
    tight = machine(room=minimum_bytes(machine(), WORK) + 10 * LAYER_BYTES, read_bps=2e8)
    t = search(tight, WORK)
    assert t.policy.resident_layers < SHAPE.layers and t.memory <= tight.room


@pytest.mark.parametrize("layers", [0, 1, 7, 29])
def test_search_holds_no_more_layers_than_the_weights_room(layers):
    # memory is ample, reads dominate: the search would hold every layer, but the weights' share
    # of the plan has room for `layers` of them (and a little more)
    m = machine(room=4 * GB, read_bps=2e8, weights_room=layers * LAYER_BYTES + LAYER_BYTES // 2)
    c = search(m, WORK)
    assert c.policy.resident_layers == layers
    assert fits(m, WORK, c.policy) and not fits(m, WORK, replace(c.policy, resident_layers=layers + 1))
    share = resident_share(m, WORK, Policy(8, 4))
    assert 0.0 <= share <= 1.0 and share * SHAPE.layers * LAYER_BYTES <= m.weights_room * (1 + 1e-6)


def test_describe_refuses_a_given_policy_that_does_not_fit():
    m = machine(room=64 << 20, weights_room=5 * LAYER_BYTES)
    assert describe(m, WORK, Policy(2, 2, 5)).memory == memory_bytes(m, WORK, Policy(2, 2, 5))
    for p in (Policy(2, 2, 6), Policy(128, 128)):  # too many layers for the weights' share; too big a block
        assert not fits(m, WORK, p)
        with pytest.raises(MemoryBudgetError) as e:
            describe(m, WORK, p)
        assert fmt(memory_bytes(m, WORK, p)) in str(e.value) and "\n" not in str(e.value)


def test_search_passes_order_and_overlap_on():
    c = search(machine(), WORK, order=Order.ROW, overlap=False)
    assert c.policy.order is Order.ROW and c.policy.overlap is False


@pytest.mark.parametrize("short", [1, 1 << 20, None])
def test_search_refuses_a_room_below_the_minimum_naming_it(short):
    need = minimum_bytes(machine(), WORK)
    room = -5 if short is None else need - short
    with pytest.raises(MemoryBudgetError) as e:
        search(machine(room=room), WORK)
    msg = str(e.value)
    assert fmt(need) in msg and "\n" not in msg, msg
    assert f"leaves {fmt(max(room, 0))}" in msg


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_resident_share_is_a_share(name):
    base = MACHINES[name]
    for room in rooms(base, WORK):
        m = machine(room=room, read_bps=base.read_bps, attn=base.attn_read_bytes)
        for (gb, nb), order, overlap, bits in itertools.product(SHAPES, Order, (True, False), (0, 4)):
            p = Policy(gb, nb, kv_bits=bits, order=order, overlap=overlap)
            s = resident_share(m, WORK, p)
            if memory_bytes(m, WORK, p) > room:
                assert s is None  # even nothing resident does not fit
                continue
            assert s is not None and 0.0 <= s <= 1.0, (p, s)
            # the share it places fits the room
            free = room - memory_bytes(m, WORK, p)
            assert s * SHAPE.layers * LAYER_BYTES <= free * (1 + 1e-6) + 1


def test_resident_share_fills_the_room_when_reads_dominate():
    p = Policy(8, 4)
    fixed = memory_bytes(machine(), WORK, p)
    assert resident_share(machine(room=4 * GB, read_bps=2e8), WORK, p) == pytest.approx(1.0)
    half = machine(room=fixed + 15 * LAYER_BYTES, read_bps=2e8)
    assert resident_share(half, WORK, p) == pytest.approx(0.5, abs=1e-6)
    assert resident_share(machine(room=fixed, read_bps=2e8), WORK, p) == pytest.approx(0.0, abs=1e-9)
    assert resident_share(machine(room=fixed - 1, read_bps=2e8), WORK, p) is None


def test_a_prefill_pass_packs_prompts_only_where_the_room_holds_its_buffers():
    """Several short prompts' chunks share a PACKED_PASS-token pass when the room holds that pass's
    buffers beside the policy; a tight room, a block of one sequence or prompts as long as the pass
    get one prompt's chunk per pass (0)."""
    p = Policy(8, 1)
    need = memory_bytes(machine(), WORK, p, PACKED_PASS)
    assert need > memory_bytes(machine(), WORK, p)  # the larger pass's buffers are counted
    assert prefill_pass(machine(room=need), WORK, p) == PACKED_PASS
    assert prefill_pass(machine(room=need - 1), WORK, p) == 0
    assert prefill_pass(machine(), WORK, Policy(1, 1)) == 0
    assert prefill_pass(machine(), replace(WORK, prompt=PACKED_PASS), p) == 0
