"""Plain-ops reference of the CPU quantized matmul (cpu/qmatmul.cpp): dequantize the stored codes to
float64 with numpy, then matmul. Slow and memory-hungry on purpose: it is what the kernel must equal
up to float32 rounding, and nothing on the per-token path calls it."""

from __future__ import annotations

import numpy as np

from mlx_flash.kernels.qmatmul import unpack_codes  # the store's layout, shared with embedding lookups


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int) -> np.ndarray:
    """w = q * scale + bias per group along the last axis, in float64."""
    q = unpack_codes(packed, bits).astype(np.float64)
    s = np.repeat(scales.astype(np.float64), group, axis=-1)
    b = np.repeat(biases.astype(np.float64), group, axis=-1)
    return q * s + b


def qmatmul_ref(
    x: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    group: int,
    transposed: bool = True,
) -> np.ndarray:
    """x [T, K] @ W^T (W stored [N, K], transposed) or x @ W (W stored [K, N]), in float64."""
    w = dequantize(packed, scales, biases, bits, group)
    return x.astype(np.float64) @ (w.T if transposed else w)
