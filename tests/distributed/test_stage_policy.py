"""The throughput mode's micro-batch search over the pipeline's stages (distributed/stage_policy.py)."""

import pytest

from mlx_flash.distributed.stage_policy import (
    WIRE_WORDS,
    StageSpeed,
    calibrate,
    choose,
    choose_prefill,
    stage_speed,
    step_seconds,
)


def compute_bound(layers=10, per_row=1e-3):
    return StageSpeed(layers=layers, streamed=0, dec_fixed=0.0, dec_per_row=per_row, read_s=0.0)


def test_a_stage_reads_each_streamed_layer_once_per_micro_batch_behind_its_compute():
    s = StageSpeed(
        layers=4, streamed=3, dec_fixed=0.01, dec_per_row=0.001, read_s=0.05, extra_fixed=0.002, extra_per_row=0.0005
    )
    # one resident layer computes; three streamed ones take the longer of compute and read
    assert s.seconds(10) == pytest.approx(0.02 + 3 * 0.05 + 0.002 + 0.005)
    assert s.seconds(100) == pytest.approx(4 * 0.11 + 0.002 + 0.05)  # compute now hides the reads


def test_the_step_is_a_trip_round_the_ring_or_the_busiest_ranks_work():
    a, b = compute_bound(per_row=1e-3), compute_bound(per_row=3e-3)
    one = step_seconds([a, b], 12, 1, hop_s=0.001)
    assert (one.rows, one.step_s) == (12, pytest.approx(0.12 + 0.36 + 0.002))  # ranks take turns
    four = step_seconds([a, b], 12, 4)
    assert (four.rows, four.step_s) == (3, pytest.approx(4 * 0.09))  # rank 1 never waits: 4 of its stages
    assert step_seconds([a, b], 3, 8).micro_batches == 3  # never more micro-batches than sequences
    uneven = step_seconds([a, b], 13, 4)  # 4, 3, 3, 3 rows: rank 1 busy for all 13, a trip at 4 rows
    assert (uneven.rows, uneven.step_s) == (4, pytest.approx(0.39))
    assert four.tokens_per_s == pytest.approx(12 / four.step_s)


def test_compute_bound_stages_keep_one_micro_batch_per_rank_in_flight():
    c = choose([compute_bound(), compute_bound()], 16)
    assert (c.micro_batches, c.rows) == (2, 8)  # 1 leaves a rank idle; more only adds messages (a tie)
    assert choose([compute_bound()] * 3, 16, hop_s=1e-3).micro_batches >= 3


def test_read_bound_ranks_sharing_a_drive_take_turns():
    # every streamed layer is read again for each micro-batch: reading costs what computing 50 rows does;
    # two ranks on one drive read at half its rate when both read at once
    shared = StageSpeed(layers=10, streamed=10, dec_fixed=0.0, dec_per_row=1e-3, read_s=0.05, drive_share=2)
    one = choose([shared, shared], 16)
    assert (one.micro_batches, one.step_s) == (1, pytest.approx(1.0))
    assert step_seconds([shared, shared], 16, 2).step_s == pytest.approx(2.0)
    # with plenty of rows the compute hides the reads again and both ranks are kept busy
    assert choose([shared, shared], 400).micro_batches == 2


def test_a_stage_speed_crosses_the_wire_in_nanoseconds():
    s = StageSpeed(
        layers=15,
        streamed=7,
        dec_fixed=0.0123,
        dec_per_row=4.5e-5,
        read_s=0.0386,
        extra_fixed=0.001,
        extra_per_row=2e-6,
        drive_share=2,
        pre_fixed=0.002,
        pre_per_token=3e-4,
    )
    wire = s.to_wire()
    assert wire.shape == (WIRE_WORDS,) and wire.max() < 2**31
    back = StageSpeed.from_wire(wire)
    assert (back.layers, back.streamed, back.drive_share) == (15, 7, 2)
    assert back.seconds(8, concurrent=True) == pytest.approx(s.seconds(8, concurrent=True), rel=1e-6)
    assert back.prefill().seconds(100) == pytest.approx(s.prefill().seconds(100), rel=1e-6)


def test_prefill_is_planned_per_prompt_token():
    # decode reads bound these ranks (one micro-batch), but a prompt token costs what 30 decode rows do
    s = StageSpeed(
        layers=10,
        streamed=10,
        dec_fixed=0.0,
        dec_per_row=1e-3,
        read_s=0.05,
        drive_share=2,
        pre_fixed=0.001,
        pre_per_token=0.03,
    )
    assert choose([s, s], 6).micro_batches == 1
    p = s.prefill()
    assert (p.dec_fixed, p.dec_per_row, p.extra_per_row) == (0.001, 0.03, 0.0)
    assert choose([p, p], 120).micro_batches >= 2  # compute-bound prefill keeps both ranks busy
    # as one pass: more, smaller messages shorten the ramp (the first message's trip) ...
    assert choose_prefill([s, s], 120) > 2
    # ... until each message's fixed cost and reads outweigh it
    reads = StageSpeed(
        layers=10,
        streamed=10,
        dec_fixed=0.0,
        dec_per_row=0.0,
        read_s=0.5,
        drive_share=2,
        pre_fixed=0.001,
        pre_per_token=1e-4,
    )
    assert choose_prefill([reads, reads], 120) == 1
    with pytest.raises(ValueError, match="at least one token"):
        choose_prefill([s], 0)


def test_no_sequences_is_refused():
    with pytest.raises(ValueError, match="at least one sequence"):
        choose([compute_bound()], 0)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_stage_is_measured_on_its_own_layers(store_dir, engines, backend):
    e = engines(store_dir, backend)
    outer, inner = (stage_speed(e, calibrate(e, r == 0), 0, 1) for r in (0, 1))
    assert outer.layers == e.args.num_hidden_layers and outer.streamed == 0 and outer.read_s == 0.0
    assert outer.dec_fixed + outer.dec_per_row > 0 and outer.pre_fixed + outer.pre_per_token > 0
    assert outer.extra_fixed + outer.extra_per_row > 0  # rank 0 computes the head
    assert inner.extra_fixed == inner.extra_per_row == 0.0
