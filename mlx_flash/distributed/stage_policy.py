"""How many micro-batches the throughput mode keeps in flight through the ranks: one process's policy
search (offload/search.py) over the pipeline's stages (FlexGen §4.4). Each rank measures its own
stage when it joins (`calibrate`: a timed run of one of its layers and on rank 0 the head; then
`stage_speed`: those and the reads of the layers it streams); rank 0 searches with every rank's numbers.

With m micro-batches (of b_g rows each, as even as they split), one decode step of every row takes

    step(m) = max(sum_r T_r(max_g b_g) + hops, max_r sum_g T_r(b_g))

where T_r(b) is rank r's time for one micro-batch: each of its layers computes b rows, and a layer it
streams is read once per micro-batch, overlapped with the compute before it. The first term is one
micro-batch's trip round the ring (too few in flight: ranks wait for each other), the second the
busiest rank's work for all of them (enough in flight: it never waits). Fewer, larger micro-batches
read a streamed layer fewer times a step; more keep every rank busy: the search weighs the two.
Ranks on one machine share its drive: with one micro-batch they take turns and each reads at the
drive's whole rate, with several they read at once and each gets its share.

Prefill is one pass, not a repeating step: its M messages (the prompts' tokens split evenly, a
prompt token standing for a row: StageSpeed.prefill) take the first one's trip round the ring and
then the busiest rank's time for each of the others,

    prefill(M) = sum_r P_r(n / M) + hops + (M - 1) x max_r P_r(n / M),

so more, smaller messages shorten the ramp while each one costs its fixed time and its reads again.

The measurement is offline work at start; `choose` runs once per batch.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import numpy as np

from ..offload.engine_room import read_bps, streams_layers
from ..memory.allocator import return_free_memory
from ..offload.calibration import measure_compute

NS = 1e-9
WIRE_WORDS = 10  # StageSpeed.to_wire's length
# the calibration's shape: prefill chunks of CALIBRATION_PROMPT / 4 and CALIBRATION_PROMPT tokens, decode
# steps of 1 and CALIBRATION_ROWS rows over CALIBRATION_CONTEXT tokens (one layer's KV of 1,024 tokens:
# less than any rank's KV plan holds for its layers)
CALIBRATION_PROMPT, CALIBRATION_ROWS, CALIBRATION_CONTEXT = 32, 8, 128


@dataclass(frozen=True)
class StageSpeed:
    """One rank's stage, measured: `layers` layers of which `streamed` read their FFN (and streamed
    attention) every micro-batch; one layer's decode step of b rows takes dec_fixed + dec_per_row x b
    seconds and a streamed layer's read `read_s`; `extra_fixed` / `extra_per_row` are the rank's
    work outside its layers (rank 0: the head, timed; its embedding lookup and sampling are left out)."""

    layers: int
    streamed: int
    dec_fixed: float
    dec_per_row: float
    read_s: float
    extra_fixed: float = 0.0
    extra_per_row: float = 0.0
    drive_share: int = 1  # ranks reading this rank's drive (ranks on its machine)
    pre_fixed: float = 0.0  # one layer's prefill of a chunk of T tokens: pre_fixed + pre_per_token x T
    pre_per_token: float = 0.0

    def prefill(self) -> "StageSpeed":
        """This stage for prefill messages, where a row is a prompt token (the head runs once per
        sequence, which the per-token cost leaves out)."""
        return replace(self, dec_fixed=self.pre_fixed, dec_per_row=self.pre_per_token, extra_per_row=0.0)

    def seconds(self, rows: int, concurrent: bool = False) -> float:
        """One micro-batch of `rows` rows through this stage; `concurrent`: the other ranks on this
        machine read at the same time."""
        c = self.dec_fixed + self.dec_per_row * rows
        read = self.read_s * (self.drive_share if concurrent else 1)
        layers = (self.layers - self.streamed) * c + self.streamed * max(c, read)
        return layers + self.extra_fixed + self.extra_per_row * rows

    def to_wire(self) -> np.ndarray:
        """Integers for Transport.all_gather (times in nanoseconds, each under 2.1 s)."""
        times = [
            self.dec_fixed,
            self.dec_per_row,
            self.read_s,
            self.extra_fixed,
            self.extra_per_row,
            self.pre_fixed,
            self.pre_per_token,
        ]
        return np.array(
            [self.layers, self.streamed, self.drive_share] + [min(int(round(t / NS)), 2**31 - 1) for t in times]
        )

    @classmethod
    def from_wire(cls, v) -> "StageSpeed":
        v = [int(x) for x in v]
        dec_fixed, dec_per_row, read_s, extra_fixed, extra_per_row, pre_fixed, pre_per_token = (x * NS for x in v[3:10])
        return cls(
            v[0],
            v[1],
            dec_fixed,
            dec_per_row,
            read_s,
            extra_fixed,
            extra_per_row,
            drive_share=v[2],
            pre_fixed=pre_fixed,
            pre_per_token=pre_per_token,
        )


def micro_batches_text(m: int) -> str:
    return f"{m} micro-batch" + ("es" if m != 1 else "")


@dataclass(frozen=True)
class StageChoice:
    sequences: int
    micro_batches: int
    rows: int  # per micro-batch (the largest)
    step_s: float  # predicted seconds of one decode step of every sequence
    stage_s: tuple  # each rank's seconds for one (the largest) micro-batch, alone on its drive

    @property
    def tokens_per_s(self) -> float:
        return self.sequences / self.step_s if self.step_s > 0 else float("inf")

    def line(self) -> str:
        stages = ", ".join(f"rank {r} {t * 1e3:.0f} ms" for r, t in enumerate(self.stage_s))
        return (
            f"pipeline policy: {micro_batches_text(self.micro_batches)} of up to {self.rows} rows for {self.sequences} "
            f"sequences; a decode step predicted {self.step_s:.3f} s ({self.tokens_per_s:.1f} tok/s); "
            f"one micro-batch per stage: {stages}"
        )


def step_seconds(stages: list[StageSpeed], sequences: int, micro_batches: int, hop_s: float = 0.0) -> StageChoice:
    """The predicted decode step of `sequences` rows in `micro_batches` micro-batches (module docstring)."""
    m = max(1, min(micro_batches, sequences))
    sizes = [sequences // m + (g < sequences % m) for g in range(m)]
    trip = tuple(s.seconds(sizes[0]) for s in stages)
    busy = max(sum(s.seconds(b, concurrent=m > 1) for b in sizes) for s in stages)
    step = max(sum(trip) + hop_s * len(stages), busy)
    return StageChoice(sequences=sequences, micro_batches=m, rows=sizes[0], step_s=step, stage_s=trip)


def choose(stages: list[StageSpeed], sequences: int, hop_s: float = 0.0, most: int = 0) -> StageChoice:
    """The micro-batch count with the shortest predicted step, from 1 to `most` (default: twice the
    ranks), never more than the sequences; ties go to fewer (fewer messages)."""
    if sequences < 1:
        raise ValueError("a pipeline policy needs at least one sequence")
    top = max(1, min(sequences, most or 2 * len(stages)))
    options = [step_seconds(stages, sequences, m, hop_s) for m in range(1, top + 1)]
    return min(options, key=lambda c: (c.step_s, c.micro_batches))


def calibrate(engine, outer: bool) -> tuple:
    """This rank's compute, timed on its own layers (its engine loads only them): one layer's prefill
    and decode steps (offload/calibration.py) and, on rank 0 (`outer`), the head's decode step as
    (fixed, per row). Run before FFN layers are placed, so the calibration's buffers come out of the
    room they would take, and are handed back after."""

    c = measure_compute(engine, CALIBRATION_PROMPT, CALIBRATION_CONTEXT, CALIBRATION_ROWS)
    head = _head_speed(engine) if outer else (0.0, 0.0)
    return_free_memory()
    return c, head


def stage_speed(engine, calibration: tuple, held: int, drive_share: int) -> StageSpeed:
    """This rank's stage: the calibration's compute, and the reads of the layers it streams (FFN
    layers past the `held` first, attention read when it computes) at the disk profile's rate
    (shared with `drive_share` ranks when they read at once)."""
    c, (head_fixed, head_per_row) = calibration
    n = engine.args.num_hidden_layers
    lay = engine.store.manifest.ffn
    slots = engine.layer_slots
    reads = [
        (lay.layer_nbytes if streams_layers(engine) and i >= held else 0)
        + (slots.regions[i][2] if slots is not None and i in slots else 0)
        for i in range(n)
    ]
    streamed = [r for r in reads if r]
    read_s = (sum(streamed) / len(streamed)) / read_bps(engine) if streamed else 0.0
    return StageSpeed(
        layers=n,
        streamed=len(streamed),
        dec_fixed=c.dec_fixed,
        dec_per_row=c.dec_per_row,
        read_s=read_s,
        extra_fixed=head_fixed,
        extra_per_row=head_per_row,
        drive_share=max(1, drive_share),
        pre_fixed=c.pre_fixed,
        pre_per_token=c.pre_per_token,
    )


def _head_speed(engine, repeats: int = 3) -> tuple[float, float]:
    """(fixed, per row) seconds of the head (final norm and logits) on one decode step."""
    ops, mod = engine.ops, engine.module
    rng = np.random.default_rng(0)
    d = engine.args.hidden_size

    def timed(rows: int) -> float:
        h = ops.array(rng.standard_normal((rows, 1, d)).astype(np.float32))
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            ops.materialize(mod.head(ops, engine.args, engine.weights, h))
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    with ops.inference():
        timed(1)  # buffers made
        one, many = timed(1), timed(CALIBRATION_ROWS)
    per_row = max(0.0, (many - one) / (CALIBRATION_ROWS - 1))
    return max(0.0, one - per_row), per_row


def choose_prefill(stages: list[StageSpeed], tokens: int, hop_s: float = 0.0, most: int = 16) -> int:
    """How many messages the prompts' `tokens` prefill in (module docstring), from 1 to `most`."""
    if tokens < 1:
        raise ValueError("a prefill needs at least one token")
    pre = [s.prefill() for s in stages]

    def seconds(m: int) -> float:
        size = -(-tokens // m)
        trip = sum(s.seconds(size) for s in pre) + hop_s * len(pre)
        return trip + (m - 1) * max(s.seconds(size, concurrent=True) for s in pre)

    return min(range(1, min(tokens, most) + 1), key=lambda m: (seconds(m), m))
