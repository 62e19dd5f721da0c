"""Per-token latency model (LLM in a flash §3, Appendix C): I/O from the disk profile, plus memory
management and compute. I/O of one layer's batch = one first-byte latency + bytes / throughput at
the batch's mean read size with the pool's threads (throughput interpolated log-log between the
profiled chunk sizes and thread counts)."""

from __future__ import annotations

import numpy as np


def throughput(profile: dict, chunk: float, threads: int) -> float:
    """Bytes/s of random reads of `chunk` bytes with `threads` readers, interpolated."""
    table = profile["throughput"]
    tcounts = sorted(int(t) for t in table)
    t_near = min(tcounts, key=lambda t: abs(np.log2(t) - np.log2(max(threads, 1))))
    row = table[str(t_near)]
    sizes = np.array(sorted(int(c) for c in row), dtype=np.float64)
    rates = np.array([row[str(int(c))] for c in sizes], dtype=np.float64)
    x = np.log2(np.clip(chunk, sizes[0], sizes[-1]))
    return float(2 ** np.interp(x, np.log2(sizes), np.log2(rates)))


def io_seconds(profile: dict, bytes_read: float, reads: float, batches: int, threads: int) -> float:
    """Predicted blocked I/O time for `batches` layer batches moving `bytes_read` in `reads` reads."""
    if reads <= 0 or bytes_read <= 0:
        return 0.0
    return batches * profile["latency_s"] + bytes_read / throughput(profile, bytes_read / reads, threads)


def ranges_to_reads(offsets, lengths, gap: int) -> tuple[int, int]:
    """(reads, bytes) for reading these byte ranges of one file when ranges closer than `gap` bytes
    share a read (the gap bytes are read too)."""
    offsets, lengths = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if offsets.size == 0:
        return 0, 0
    order = np.argsort(offsets, kind="stable")
    start, end = offsets[order], offsets[order] + lengths[order]
    reach = np.maximum.accumulate(end)
    new = np.ones(start.size, dtype=bool)
    new[1:] = start[1:] - reach[:-1] > gap
    first = np.flatnonzero(new)
    spans = np.maximum.reduceat(end, first) - start[first]
    return int(first.size), int(spans.sum())
