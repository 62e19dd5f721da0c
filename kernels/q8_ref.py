"""Plain-ops reference of the q8 arithmetic (cpu/q8.h): each row of x quantized to int8 codes with a
scale per 8 inputs (d = max|x| / 127, codes round-half-even(x * (127 / max|x|)), all in float32),
then the stored weights, dequantized in float64, times the dequantized activations d * codes in
float64. The kernels equal it up to float32 rounding of their sums; the codes, scales and block sums
themselves equal it exactly."""

from __future__ import annotations

import numpy as np

QUARTER = 8  # inputs per activation scale


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] float32 (K a multiple of 32) -> (codes int8 [T, K], scales float32 [T, K / 8], block sums
    float32 [T, K / 32]: S = ((a0 + a1) + a2) + a3, a_u = d_u * sum(codes of quarter u), each step
    rounded to float32)."""
    T, K = x.shape
    quarters = np.asarray(x, dtype=np.float32).reshape(T, K // QUARTER, QUARTER)
    amax = np.abs(quarters).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.rint(quarters * inv[..., None]).astype(np.int8)  # float32 product, then ties to even
    a = (d * codes.astype(np.int32).sum(axis=-1).astype(np.float32)).astype(np.float32).reshape(T, K // 32, 4)
    s = a[..., 0]
    for u in range(1, 4):
        s = (s + a[..., u]).astype(np.float32)
    return codes.reshape(T, K), d.astype(np.float32), s


def dequantized_activations(x: np.ndarray) -> np.ndarray:
    """What the q8 arithmetic multiplies the weights by: d * codes, float64 [T, K]."""
    codes, d, _ = quantize(x)
    T, K = codes.shape
    return (codes.reshape(T, K // QUARTER, QUARTER).astype(np.float64) * d[..., None].astype(np.float64)).reshape(T, K)


def q8_matmul_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K] float32 times the dequantized weights w [N, K] (float64, rows are outputs), as the q8
    arithmetic computes it: float64 [T, N]."""
    return dequantized_activations(x) @ np.asarray(w, dtype=np.float64).T
