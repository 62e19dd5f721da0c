"""The one timing rule the benchmarks share: the median wall time of repeated calls after a warm-up
call (the first call pays for compiling, allocating and faulting in what the later ones reuse)."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeat: int) -> float:
    """Median wall seconds of `repeat` calls of fn(), after one untimed call."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
