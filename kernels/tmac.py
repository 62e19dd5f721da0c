"""T-MAC's table-lookup product (cpu/tmac.cpp) from Python: one row of x times an affine 4-bit matrix
(groups of 32, float16 scales and biases, rows are outputs) by table lookup instead of multiply-adds.

The kernel reads its own layout, not the store's bytes: TmacMatrix rewrites a store matrix into it
once (bit planes interleaved by blocks of 16 rows; the same size), an offline step a product never
repeats. Plain-ops reference: tmac_ref.py; tests/kernels/test_tmac.py compares the two."""

from __future__ import annotations

import ctypes
from enum import IntEnum

import numpy as np

from mlx_flash.errors import KernelUnavailableError
from mlx_flash.kernels.qmatmul import library

GROUP = 32


class TmacPath(IntEnum):
    """The kernel's code paths (cpu/tmac.cpp); AUTO is the fastest this CPU runs."""

    AUTO = 0
    PORTABLE = 1
    AVX512_BW = 2  # vpshufb lookups, vpmaddubsw into int16
    AVX512_VNNI = 3  # vpshufb lookups, vpdpbusd
    AVX512_VBMI = 4  # vpermb lookups, vpdpbusd


_BOUND = False


def _lib() -> ctypes.CDLL:
    global _BOUND
    lib = library()
    if not _BOUND:
        i64, vp, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.mf_tmac_paths.restype = i32
        lib.mf_tmac_bytes.argtypes, lib.mf_tmac_bytes.restype = [i64, i64], i64
        lib.mf_tmac_repack.argtypes, lib.mf_tmac_repack.restype = [vp, vp, vp, i64, i64, vp], i32
        lib.mf_tmac_tables.argtypes, lib.mf_tmac_tables.restype = [vp, i64, vp, vp, vp, i32], i32
        lib.mf_tmac_matvec.argtypes, lib.mf_tmac_matvec.restype = [vp, i64, i64, vp, vp, i32, i32], i32
        _BOUND = True
    return lib


def tmac_paths() -> list[TmacPath]:
    """The paths this CPU runs (PORTABLE always)."""
    bits = _lib().mf_tmac_paths()
    return [p for p in TmacPath if p != TmacPath.AUTO and bits >> int(p) & 1]


def tmac_best_path() -> TmacPath:
    """The path AUTO takes on this CPU."""
    return TmacPath(_lib().mf_tmac_paths() >> 8)


def tmac_tables(x: np.ndarray, path: TmacPath = TmacPath.AUTO) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tables a product builds from x [K] float32: (int8 [K / 4, 16], scales float32 [K / 32],
    group sums float32 [K / 32]); what tmac_ref.tables computes."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    K = x.shape[0]
    if x.ndim != 1 or K % GROUP or K == 0:
        raise ValueError(f"x must be [K] with K a multiple of {GROUP} (got {x.shape})")
    q, d, s = np.empty((K // 4, 16), np.int8), np.empty(K // GROUP, np.float32), np.empty(K // GROUP, np.float32)
    if _lib().mf_tmac_tables(x.ctypes.data, K, q.ctypes.data, d.ctypes.data, s.ctypes.data, int(path)) != 0:
        raise KernelUnavailableError(f"this CPU cannot run the T-MAC {TmacPath(path).name} path")
    return q, d, s


class TmacMatrix:
    """A store matrix (packed uint32 [N, K / 8] of 4-bit codes, scales and biases float16 [N, K / 32])
    rewritten once into the T-MAC layout; call it with x [K] float32 for y [N] float32."""

    def __init__(self, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray):
        if packed.dtype != np.uint32 or packed.ndim != 2:
            raise ValueError(f"packed weights must be 2-D uint32 (got {packed.dtype} {packed.shape})")
        N, K = packed.shape[0], packed.shape[1] * 8
        if K % GROUP or N == 0:
            raise ValueError(f"T-MAC reads 4-bit codes in groups of {GROUP} (got {N} x {K})")
        for name, a in (("scales", scales), ("biases", biases)):
            if a.dtype != np.float16 or a.shape != (N, K // GROUP):
                raise ValueError(f"{name} must be float16 {(N, K // GROUP)} (got {a.dtype} {a.shape})")
        lib = _lib()
        packed, scales, biases = (np.ascontiguousarray(a) for a in (packed, scales, biases))
        self.n_out, self.k_in = N, K
        size = lib.mf_tmac_bytes(N, K)
        # the repacked matrix, kept, on a cache line boundary: the kernel's 64-byte loads are whole
        # lines (numpy's 16-byte alignment split each load over two lines)
        raw = np.empty(size + 64, np.uint8)
        start = -raw.ctypes.data % 64
        self.data = raw[start : start + size]
        rc = lib.mf_tmac_repack(packed.ctypes.data, scales.ctypes.data, biases.ctypes.data, N, K, self.data.ctypes.data)
        if rc != 0:
            raise ValueError(f"the T-MAC repack refused its arguments (code {rc})")
        self._call = lib.mf_tmac_matvec
        self._w = self.data.ctypes.data

    @property
    def nbytes(self) -> int:
        """Bytes a product reads of the matrix (its repacked layout; the tables are not counted)."""
        return self.data.nbytes

    def __call__(
        self, x: np.ndarray, threads: int = 1, out: np.ndarray | None = None, path: TmacPath = TmacPath.AUTO
    ) -> np.ndarray:
        """x [K] float32 (C-contiguous) -> y [N] float32 (into `out` when given)."""
        if x.dtype != np.float32 or x.shape != (self.k_in,) or not x.flags.c_contiguous:
            raise ValueError(f"x must be a contiguous float32 [{self.k_in}] (got {x.dtype} {x.shape})")
        if out is None:
            out = np.empty(self.n_out, np.float32)
        elif out.dtype != np.float32 or out.shape != (self.n_out,) or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 [{self.n_out}] (got {out.dtype} {out.shape})")
        rc = self._call(self._w, self.n_out, self.k_in, x.ctypes.data, out.ctypes.data, max(threads, 1), int(path))
        if rc != 0:
            raise KernelUnavailableError(f"this CPU cannot run the T-MAC {TmacPath(path).name} path (code {rc})")
        return out
