"""Throughput mode end to end: the workload measured, the machine described (room under the one
memory limit, disk profile, a calibration run of one layer), the policy searched or given, the
weights placed as it says, the batch run, and the prediction set beside the measurement."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from ..batching.progress_bar import chain_done, progress_bar, tick
from ..batching.prompts import BatchStats, encode_all
from ..batching.sequence import SamplingOptions
from ..errors import ConfigError
from ..memory import process_rss
from ..memory.process_plan import RUNTIME_SLACK, ModelShape
from ..sampling import shown
from ..units import fmt
from .batch_generate import generate_batch
from .calibration import measure_compute
from .cost_model import Machine, Workload, prefill_pass
from .engine_room import check_whole_layers, read_bps, streams_layers, weights_room
from .policy import Policy
from .search import Choice, describe, search

ROOM_SHARE = 0.8  # of what the limit leaves, what a policy may plan for (allocators keep freed memory)


@dataclass
class BatchRun(BatchStats):
    predicted_s: float = 0.0
    predicted_tokens_per_s: float = 0.0
    memory_planned: int = 0
    room: int = 0
    compute: dict = field(default_factory=dict)
    weights: str = ""  # where the weights are: "resident" (loaded so), or "placed" by the policy
    prefill_pass: int = 0  # tokens of a packed prefill pass (cost_model.prefill_pass; 0: one prompt's chunk)

    def line(self) -> str:
        """The policy, its prediction and the measurement side by side."""
        return (
            f"policy {json.dumps(self.policy)}: predicted {self.predicted_s:.1f} s "
            f"({self.predicted_tokens_per_s:.1f} tok/s), "
            f"measured {self.seconds:.1f} s ({self.tokens_per_s:.1f} tok/s) for {self.sequences} sequences, "
            f"{self.generated_tokens} tokens; the policy holds {fmt(self.memory_planned)} of {fmt(self.room)}"
            + ("; the whole model resident" if self.weights == "resident" else "")
            + (f"; prefill passes of {self.prefill_pass} tokens" if self.prefill_pass else "")
        )


def describe_machine(engine, workload: Workload, max_rows: int) -> Machine:
    lay = engine.store.manifest.ffn
    L = engine.args.num_hidden_layers
    streamed = streams_layers(engine)
    compute = measure_compute(engine, workload.prompt, workload.prompt + workload.generate // 2, max_rows)
    plan = engine.memory_plan
    # the room: what the limit leaves beside this process now (the model loaded, a pass run) and the
    # runtime's slack, less a margin for the allocators' fragmentation
    room = int(((plan.get("limit") or 0) - process_rss() - RUNTIME_SLACK[engine.config.backend.value]) * ROOM_SHARE)
    slots = engine.layer_slots
    attn = tuple(slots.regions[i][2] if slots is not None and i in slots else 0 for i in range(L))
    return Machine(
        room=room,
        weights_room=weights_room(engine, room),
        ffn_layer_bytes=lay.layer_nbytes if streamed else 0,
        n_layers=L,
        read_bps=read_bps(engine) if streamed or any(attn) else 1e12,
        compute=compute,
        shape=ModelShape.from_config(engine.store.config),
        attn_read_bytes=attn,
    )


def choose(engine, workload: Workload, policy: Policy | None, kv_bits=(0,)) -> tuple[Machine, Choice]:
    """The machine and the policy (searched when None), checked against the room."""
    rows = min(workload.sequences, 32) if policy is None else policy.gpu_batch
    m = describe_machine(engine, workload, rows)
    if policy is None:
        c = search(m, workload, kv_bits)
    else:
        policy.check(m.n_layers)
        if not streams_layers(engine) and policy.resident_layers:
            raise ConfigError(
                "policy: resident_layers places FFN layers of a model read whole from flash (ffn stream); "
                "this engine's FFN is already placed"
            )
        c = describe(m, workload, policy)
    if not streams_layers(engine):
        c = replace(c, policy=replace(c.policy, resident_layers=0))
    return m, c


def run_batch(
    engine,
    prompts,
    max_tokens,
    opts: SamplingOptions,
    policy: Policy | None,
    progress: bool,
    on_done=None,
    kv_bits=(0,),
) -> tuple[list, BatchRun]:
    """The throughput mode in one process: every prompt's Sequence in prompt order and the run's stats
    (policy: searched when None; kv_bits: the KV widths the search may pick)."""
    if policy is not None and not isinstance(policy, Policy):
        raise ConfigError(f"policy must be a mlx_flash.Policy or None (got {shown(policy)})")
    check_whole_layers(engine)
    work = encode_all(engine, prompts, max_tokens)
    workload = Workload(sequences=len(work), prompt=max(len(ids) for ids, _ in work), generate=max(n for _, n in work))
    m, c = choose(engine, workload, policy, kv_bits)
    p = c.policy
    run = BatchRun(
        predicted_s=c.seconds,
        predicted_tokens_per_s=c.tokens_per_s,
        memory_planned=c.memory,
        room=m.room,
        compute=asdict(m.compute),
        weights="placed" if streams_layers(engine) else "resident",
        prefill_pass=prefill_pass(m, workload, p),
    )
    slots = engine.layer_slots
    placed = streams_layers(engine)  # a StreamedFFN (ffn stream, dense): the policy places its layers
    if placed:
        engine.ffn.place(p.resident_layers, p.overlap)
    if slots is not None:
        slots.read_ahead = p.overlap
    bar = progress_bar(len(work), progress)
    t0 = time.perf_counter()
    try:
        seqs, stats = generate_batch(
            engine,
            work,
            opts,
            p,
            run.prefill_pass,
            on_done=chain_done(on_done, bar),
            on_token=(lambda n: tick(bar, n, t0)) if bar else None,
        )
    finally:
        if placed:
            engine.ffn.place(0, True)  # held layers go: the memory is the next run's to plan
        if slots is not None:
            slots.read_ahead = True
        if bar:
            bar.close()
    for f in vars(stats):
        setattr(run, f, getattr(stats, f))
    if progress:
        print(run.line(), file=sys.stderr)
    return seqs, run
