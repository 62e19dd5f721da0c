"""I/O-only replay of the sparse FFN path: drive a SparseFFN's caches and reads with an activity
model (no compute), one token at a time over every layer, and record per-token I/O next to the cost
model's estimate. This is how the big synthetic stores are measured: their weights are random, so
only the I/O and memory side is meaningful."""

from __future__ import annotations

import time

from . import cost_model


def replay(src, activity, tokens: int, profile: dict, progress: bool = False) -> list[dict]:
    from tqdm import tqdm

    lay = src.layout
    L = len(lay.layer_offsets)
    out = []
    for _ in tqdm(range(tokens), desc=f"replay {src.plan.mode}", unit="token", disable=not progress):
        io0, mem0, b0, r0, rows0 = src.io_seconds, src.mem_seconds, src.bytes_read, src.reads, src.rows_loaded
        t = time.perf_counter()
        for i in range(L):
            if src.plan.mode in ("naive", "hybrid"):
                src.dense_rows(i, decode=True)
            else:
                src.fetch(i, activity.active(i))
        wall = time.perf_counter() - t
        nbytes, nreads = src.bytes_read - b0, src.reads - r0
        out.append({"io_ms": (src.io_seconds - io0) * 1e3, "mem_ms": (src.mem_seconds - mem0) * 1e3,
                    "wall_ms": wall * 1e3, "bytes": nbytes, "reads": nreads,
                    "rows_loaded": src.rows_loaded - rows0,
                    "model_io_ms": cost_model.io_seconds(profile, nbytes, nreads, L, src.pool.threads) * 1e3})
    return out
