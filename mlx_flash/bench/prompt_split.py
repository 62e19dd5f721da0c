"""Where a long prompt's prefill spends its time: the wall time of the prefill (median of runs from an
empty cache), and on the torch backend one more run under torch's profiler, whose self times of our
operators split it into the linear products (every product over stored weights: the fused FFN, the
other matrices, the experts), attention, and the rest (norms, rope, the cache, torch's own operators,
Python), the rest taken as the wall time less the first two. MLX runs the same kernels as primitives
of its graph, which no profiler here times one by one: its prefill is given as a wall time."""

from __future__ import annotations

import statistics
import time

LINEAR = ("mlx_flash::gated_ffn", "mlx_flash::stored_matmul", "mlx_flash::moe_experts")
ATTENTION = ("mlx_flash::attention", "mlx_flash::attention_coded", "mlx_flash::attention_mixed")


def prefill_seconds(engine, ids) -> float:
    caches = engine.new_caches()
    t = time.perf_counter()
    engine.prefill(ids, caches)
    return time.perf_counter() - t


def prefill_split(engine, ids, runs: int = 3) -> dict:
    """{"seconds": median wall time, "all": each run's} and, on torch, {"linear_s", "attention_s",
    "rest_s"} from one profiled run (its own wall time as "profiled_s": the profiler's cost shows as
    the difference)."""
    prefill_seconds(engine, ids)  # warm-up
    times = [prefill_seconds(engine, ids) for _ in range(runs)]
    out = {"tokens": len(ids), "seconds": statistics.median(times), "all": times}
    if engine.ops.name != "torch":
        return out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = prefill_seconds(engine, ids)
    self_s = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    linear = sum(self_s.get(k, 0.0) for k in LINEAR)
    attention = sum(self_s.get(k, 0.0) for k in ATTENTION)
    out.update(linear_s=linear, attention_s=attention, rest_s=out["seconds"] - linear - attention, profiled_s=profiled)
    return out
