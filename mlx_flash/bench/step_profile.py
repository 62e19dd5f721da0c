"""Where a decode step's time goes on torch: one step of `rows` sequences (each holding `held` tokens,
as batch_passes.decode_step builds them) run under torch's profiler, its operators' own time per step
(the products over stored weights, attention, torch's small operators) and the rest of the wall time,
which is Python's between operators."""

from __future__ import annotations

import time

import numpy as np

from ..batching.batch_cache import BlockKV
from ..batching.schedule import MicroBatch, Order, run_block
from ..models.cache import make_caches


def step_profile(engine, rows: int, held: int = 128, steps: int = 5, seed: int = 0, min_ms: float = 0.1) -> dict:
    """{"step_ms": unprofiled wall time a step, "ops_ms": {operator: its own ms a step} (those of
    min_ms or more, largest first), "python_ms": the profiled wall time less every operator's}. Torch only."""
    from torch.profiler import ProfilerActivity, profile  # deferred: torch is optional for MLX users

    rng = np.random.default_rng(seed)
    L, vocab = engine.args.num_hidden_layers, engine.args.vocab_size
    seqs = [make_caches(L, held + 3 * steps + 2) for _ in range(rows)]
    for caches in seqs:
        engine.forward(rng.integers(0, vocab, size=held).tolist(), caches)
    block = [BlockKV(engine.ops, [c[i] for c in seqs], held + 3 * steps + 2) for i in range(L)]
    tokens = engine.ops.tokens(rng.integers(0, vocab, size=(rows, 1)).tolist())

    def step():
        run_block(engine, [MicroBatch(tokens, block)], Order.ZIGZAG)

    step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    step_ms = (time.perf_counter() - t) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        profiled_ms = (time.perf_counter() - t) / steps * 1e3
    own = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    ops = {k: v for k, v in sorted(own.items(), key=lambda kv: -kv[1]) if v >= min_ms}
    return {"rows": rows, "step_ms": step_ms, "ops_ms": ops, "python_ms": profiled_ms - sum(own.values())}
