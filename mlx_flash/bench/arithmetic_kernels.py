"""The CPU product in each arithmetic (exact float, q8 integer) at the shapes that matter: the default
model's decode matrices, which stay in cache, and a 7B FFN's, which do not; 1, 16 and 64 rows; 1 and
2 threads; each code path the CPU can run. Affine 4-bit codes in groups of 32 with float16 scales and
biases (the store's layout). A shape whose matrices outgrow the last-level cache is timed over enough
distinct copies in rotation that every call reads from memory, as decode does."""

from __future__ import annotations

import numpy as np

from ..kernels.qmatmul import Arith, StoredMatrix, cpu_isa, runnable_isas, use_isa
from .timing import median_seconds

# (name, outputs N, inputs K)
SHAPES = {"default gate_up": (3072, 576), "default down": (576, 1536), "7B up": (14336, 4096), "7B down": (4096, 14336)}
CACHE_BYTES = 32 << 20  # what a rotation must exceed several times over (this class of CPU's L3)


def random_matrix(rng, n: int, k: int, bits: int = 4, group: int = 32) -> StoredMatrix:
    words = rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32)
    scales = (rng.standard_normal((n, k // group)) * 0.01).astype(np.float16)
    biases = (rng.standard_normal((n, k // group)) * 0.05).astype(np.float16)
    return StoredMatrix(words, scales, biases, bits, group, True, False)


def stored_bytes(m: StoredMatrix) -> int:
    return sum(a.nbytes for a in m.arrays)


def rotation(rng, n: int, k: int) -> list[StoredMatrix]:
    """One matrix, or enough distinct ones to hold 4x the cache when one alone would fit in it twice."""
    first = random_matrix(rng, n, k)
    size = stored_bytes(first)
    if size * 2 <= CACHE_BYTES:
        return [first]
    return [first] + [random_matrix(rng, n, k) for _ in range(-(-4 * CACHE_BYTES // size) - 1)]


def time_product(mats: list[StoredMatrix], rows: int, threads: int, arith: Arith, repeat: int) -> float:
    """Median seconds of one product (of one matrix of the rotation per call, in turn)."""
    k = mats[0].k_in
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    out = np.empty((rows, mats[0].n_out), np.float32)
    turn = [0]

    def call():
        mats[turn[0] % len(mats)].into(x, rows, out, threads, arith)
        turn[0] += 1

    return median_seconds(call, max(repeat, len(mats)))


def arithmetic_table(shapes, rows, threads, repeat: int = 20, levels: bool = False) -> list[dict]:
    """A row per shape, rows, threads: exact and q8 milliseconds, GB/s of the stored bytes and the q8
    speedup; with `levels`, both at one row on each code path this CPU runs (forced, one at a time)."""
    rng, out = np.random.default_rng(0), []
    for name in shapes:
        n, k = SHAPES[name]
        mats = rotation(rng, n, k)
        size = stored_bytes(mats[0])
        for t in rows:
            for th in threads:
                row = {"shape": name, "N": n, "K": k, "rows": t, "threads": th, "stored_MB": size / 1e6}
                for arith in (Arith.EXACT, Arith.Q8):
                    s = time_product(mats, t, th, arith, repeat)
                    key = arith.name.lower()
                    row[f"{key}_ms"], row[f"{key}_GBs"] = s * 1e3, size / s / 1e9
                    row[f"{key}_GMACs"] = n * k * t / s / 1e9
                row["q8_speedup"] = row["exact_ms"] / row["q8_ms"]
                out.append(row)
        if levels:
            found = cpu_isa()
            try:
                for isa in runnable_isas():
                    use_isa(isa)
                    ms = {f"{a.name.lower()}_ms": time_product(mats, 1, 1, a, repeat) * 1e3 for a in Arith}
                    out.append({"shape": name, "rows": 1, "threads": 1, "level": isa.name} | ms)
            finally:
                use_isa(found)
    return out
