"""Plain-ops reference of the CPU quantized matmul (cpu/qmatmul.cpp): dequantize the stored codes to
float64 with numpy, then matmul. Slow and memory-hungry on purpose: it is what the kernel must equal
up to float32 rounding, and nothing on the per-token path calls it."""

from __future__ import annotations

import numpy as np


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words [R, C/(32/bits)] -> codes [R, C] (code j sits at bits*(j % per) of word j // per)."""
    per = 32 // bits
    shifts = (bits * np.arange(per, dtype=np.uint32))
    codes = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int) -> np.ndarray:
    """w = q * scale + bias per group along the last axis, in float64."""
    q = unpack_codes(packed, bits).astype(np.float64)
    s = np.repeat(scales.astype(np.float64), group, axis=-1)
    b = np.repeat(biases.astype(np.float64), group, axis=-1)
    return q * s + b


def qmatmul_ref(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int,
                transposed: bool = True) -> np.ndarray:
    """x [T, K] @ W^T (W stored [N, K], transposed) or x @ W (W stored [K, N]), in float64."""
    w = dequantize(packed, scales, biases, bits, group)
    return x.astype(np.float64) @ (w.T if transposed else w)
