"""Plain-ops reference of the q8 arithmetic (cpu/q8.h): each row of x quantized to int8 codes in
blocks of 32 (d = max|x| / 127, codes round-half-even(x * (127 / max|x|)), all in float32), then the
stored weights, dequantized in float64, times the dequantized activations d * codes in float64. The
kernels equal it up to float32 rounding of their sums; the codes themselves equal it exactly."""

from __future__ import annotations

import numpy as np


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, K] float32 (K a multiple of 32) -> (codes int8 [T, K], block scales float32 [T, K / 32])."""
    T, K = x.shape
    blocks = np.asarray(x, dtype=np.float32).reshape(T, K // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * inv[..., None])  # float32 product, then ties to even
    return codes.astype(np.int8).reshape(T, K), d.astype(np.float32)


def dequantized_activations(x: np.ndarray) -> np.ndarray:
    """What the q8 arithmetic multiplies the weights by: d * codes, float64 [T, K]."""
    codes, d = quantize(x)
    T, K = codes.shape
    return (codes.reshape(T, K // 32, 32).astype(np.float64) * d[..., None].astype(np.float64)).reshape(T, K)


def q8_matmul_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K] float32 times the dequantized weights w [N, K] (float64, rows are outputs), as the q8
    arithmetic computes it: float64 [T, N]."""
    return dequantized_activations(x) @ np.asarray(w, dtype=np.float64).T
