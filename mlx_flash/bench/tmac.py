"""T-MAC's table-lookup product (kernels/cpu/tmac.cpp) timed against the q8 VNNI product and the exact
float product of the CPU kernel, one row of x at a time (decode), on affine 4-bit matrices in groups of
32 (`python -m mlx_flash.bench.tmac` prints the table).

What each reads: exact and q8 the store's bytes (codes, float16 scales and biases); T-MAC its own
layout, which a one-time offline repack writes from the store's (the same size; not timed). Each time
is the median of repeated calls after a warm-up (timing.median_seconds), per-token work included:
q8 quantizes x, T-MAC builds its tables. T-MAC's call goes through ctypes, 2-3 us a call more than
the module function exact and q8 take (a fifth of its time on the default model's shapes). A matrix
larger than `cold_above` is one of several distinct matrices called in rotation, together at least 4
times the 32 MB L3, so that its bytes come from DRAM as in decode; smaller ones are one matrix, read
from cache. Errors: max |y - exact| / max |exact| against float64 x @ W^T of the first matrix."""

from __future__ import annotations

import math
import os
import resource
import time

import numpy as np

from ..kernels.qmatmul import Arith, StoredMatrix
from ..kernels.qmatmul_ref import dequantize
from ..kernels.tmac import TmacMatrix, tmac_best_path
from .timing import median_seconds

SHAPES = ((1536, 576), (576, 1536), (14336, 4096), (4096, 14336))  # (N outputs, K inputs): default model, 7B
L3_BYTES = 32 << 20
GROUP = 32


def store_bytes(N: int, K: int) -> int:
    """Bytes of an affine 4-bit matrix in the store: codes, then float16 scales and biases."""
    return N * K // 2 + 2 * (N * K // GROUP) * 2


def random_matrix(rng, N: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Uniform codes; scales and biases of the magnitudes the kernel tests use."""
    words = rng.integers(0, 1 << 32, size=(N, K // 8), dtype=np.uint32)
    scales = (rng.standard_normal((N, K // GROUP)) * 0.02).astype(np.float16)
    biases = (rng.standard_normal((N, K // GROUP)) * 0.1).astype(np.float16)
    return words, scales, biases


def exact_product(x: np.ndarray, words, scales, biases, rows: int = 1024) -> np.ndarray:
    """float64 x @ W^T, a block of rows at a time (a 7B matrix in float64 is 470 MB)."""
    return np.concatenate(
        [
            dequantize(words[n : n + rows], scales[n : n + rows], biases[n : n + rows], 4, GROUP) @ x.astype(np.float64)
            for n in range(0, words.shape[0], rows)
        ]
    )


def busy_seconds() -> tuple[float, float, float] | None:
    """(wall, CPU seconds every process has used, CPU seconds this one has): what others_busy is
    computed from (Linux's /proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    own = resource.getrusage(resource.RUSAGE_SELF)
    busy = sum(ticks[:3]) + sum(ticks[5:8])  # user, nice, system, irq, softirq, steal
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime


def others_busy(before, after) -> float | None:
    """Cores other processes kept busy on average between two busy_seconds() (the machine is shared:
    a time measured beside another process's work is slower, most of all on 2 threads)."""
    if before is None or after is None:
        return None
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0]))


def rotated(calls: list) -> callable:
    """One call of the next of `calls` at a time, in turn."""
    state = {"i": 0}

    def step():
        calls[state["i"] % len(calls)]()
        state["i"] += 1

    return step


def tmac_against_q8(
    shapes=SHAPES, threads=(1, 2), repeat: int = 24, seed: int = 0, cold_above: int = 8 << 20
) -> list[dict]:
    """One record per shape and thread count: for exact, q8 and tmac, ms (median of `repeat` calls)
    and GB/s of the bytes each reads, and each one's error (`*_err`) against float64; with the shape,
    the matrices in rotation, the bytes each reads, the T-MAC path taken, and the cores other
    processes kept busy meanwhile (`others_busy`: above ~0.1 the times are not this kernel's alone)."""
    rng = np.random.default_rng(seed)
    records = []
    for N, K in shapes:
        size = store_bytes(N, K)
        count = max(8, math.ceil(4 * L3_BYTES / size)) if size > cold_above else 1
        stored, tmac = [], []
        for _ in range(count):
            words, scales, biases = random_matrix(rng, N, K)
            stored.append(StoredMatrix(words, scales, biases, 4, GROUP))
            tmac.append(TmacMatrix(words, scales, biases))
        x = rng.standard_normal(K).astype(np.float32)
        x2, out2, out = x[None].copy(), np.empty((1, N), np.float32), np.empty(N, np.float32)
        exact = exact_product(x, *stored[0].arrays)
        scale = np.abs(exact).max()
        err = {
            "exact": np.abs(stored[0](x2)[0] - exact).max() / scale,
            "q8": np.abs(stored[0](x2, arith=Arith.Q8)[0] - exact).max() / scale,
            "tmac": np.abs(tmac[0](x) - exact).max() / scale,
        }
        for th in threads:
            calls = {
                "exact": [lambda m=m: m.into(x2, 1, out2, th, Arith.EXACT) for m in stored],
                "q8": [lambda m=m: m.into(x2, 1, out2, th, Arith.Q8) for m in stored],
                "tmac": [lambda m=m: m(x, th, out) for m in tmac],
            }
            rec = {"N": N, "K": K, "threads": th, "matrices": count, "store_bytes": size, "tmac_bytes": tmac[0].nbytes}
            rec["tmac_path"] = tmac_best_path().name
            start = busy_seconds()
            for name, fns in calls.items():
                seconds = median_seconds(rotated(fns), repeat)
                read = rec["tmac_bytes"] if name == "tmac" else size
                rec[f"{name}_ms"] = seconds * 1e3
                rec[f"{name}_gbps"] = read / seconds / 1e9
                rec[f"{name}_err"] = float(err[name])
            rec["others_busy"] = others_busy(start, busy_seconds())
            records.append(rec)
        del stored, tmac
    return records


def table(records: list[dict]) -> str:
    """The records as a markdown table."""
    lines = [
        "| N x K | threads | matrices | exact ms (GB/s) | q8 ms (GB/s) | T-MAC ms (GB/s) | err exact / q8 / T-MAC "
        "| others busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        cells = [f"{r[f'{n}_ms']:.3f} ({r[f'{n}_gbps']:.1f})" for n in ("exact", "q8", "tmac")]
        errs = " / ".join(f"{r[f'{n}_err']:.1e}" for n in ("exact", "q8", "tmac"))
        busy = "-" if r["others_busy"] is None else f"{r['others_busy']:.2f}"
        lines.append(
            f"| {r['N']} x {r['K']} | {r['threads']} | {r['matrices']} | {' | '.join(cells)} | {errs} | {busy} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(tmac_against_q8()))
