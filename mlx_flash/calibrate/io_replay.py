"""I/O-only replay of the sparse FFN path: drive a sparse source's caches and reads with an activity
model (no compute), one token at a time over every layer, and record per-token I/O next to the cost
model's estimate. This is how the big synthetic stores are measured: their weights are random, so
only the I/O and memory side is meaningful."""

from __future__ import annotations

import time

from ..sparse import cost_model


def replay(src, activity, tokens: int, profile: dict, progress: bool = False) -> list[dict]:
    from tqdm import tqdm

    lay = src.layout
    L = len(lay.layer_offsets)
    out = []
    for _ in tqdm(range(tokens), desc=f"replay {src.plan.mode.value}", unit="token", disable=not progress):
        s0 = src.stats()
        t = time.perf_counter()
        for i in range(L):
            src.read_step(i, activity.active(i))
        wall = time.perf_counter() - t
        s1 = src.stats()
        nbytes, nreads = s1.bytes_read - s0.bytes_read, s1.reads - s0.reads
        out.append(
            {
                "io_ms": (s1.io_seconds - s0.io_seconds) * 1e3,
                "mem_ms": (s1.mem_seconds - s0.mem_seconds) * 1e3,
                "wall_ms": wall * 1e3,
                "bytes": nbytes,
                "reads": nreads,
                "rows_loaded": s1.rows_loaded - s0.rows_loaded,
                "model_io_ms": cost_model.io_seconds(profile, nbytes, nreads, L, src.pool.threads) * 1e3,
            }
        )
    return out
