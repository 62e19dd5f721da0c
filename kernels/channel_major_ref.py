"""Plain-ops reference of the channel-major product (cpu/channel_major.cpp), with no relayout: mask x
(each channel of a row whose |x| is not above the threshold set to zero; a negative threshold keeps
every channel), dequantize the stored matrix to float64, multiply. Also the counts the kernel adds
to its counters. Slow on purpose: it is what the kernel must equal up to float32 rounding."""

from __future__ import annotations

import numpy as np

from mlx_flash.kernels.qmatmul_ref import dequantize


def active(x: np.ndarray, threshold: float) -> np.ndarray:
    """Which channels of each row of x [T, K] the product computes on (bool [T, K])."""
    if threshold < 0:
        return np.ones(x.shape, dtype=bool)
    return np.abs(x) > np.float32(threshold)


def cm_matmul_ref(
    x: np.ndarray, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int, threshold: float
) -> np.ndarray:
    """x [T, K] (float32) times W^T, W stored [N, K / (32 / bits)] words with float scales and biases
    [N, K / group] (bfloat16 ones widened to float32 first), inactive inputs zero; float64 [T, N]."""
    on = active(x, threshold)
    w = dequantize(packed, scales, biases, bits, group)
    return np.where(on, x, 0).astype(np.float64) @ w.T


def cm_counts(x: np.ndarray, group: int, threshold: float) -> np.ndarray:
    """What one product of x [T, K] adds to the counters: rows, active channels, active groups (a
    group of a row is active when any of its channels is), int64 [3]."""
    on = active(x, threshold)
    groups = on.reshape(on.shape[0], -1, group).any(axis=2)
    return np.array([on.shape[0], on.sum(), groups.sum()], dtype=np.int64)


def relayout_ref(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int) -> np.ndarray:
    """The channel-major layout (cpu/channel_major.cpp) of codes [N, K] (unpacked) with scales and
    biases [N, K / group] in their stored type, written with numpy: what mf_cm_relayout must write
    byte for byte. Outputs padded to a multiple of 64 (zero codes and scales); per group of inputs, each
    channel's codes for every output, packed 16 bytes at a time (output j of a block of 16 * (8 / bits)
    in byte j % 16 at bit bits * (j // 16)), then the group's scales, then its biases."""
    n, k = codes.shape
    groups, padded, per = k // group, -(-n // 64) * 64, 8 // bits
    q = np.zeros((padded, k), np.uint8)
    q[:n] = codes
    q = q.T.reshape(groups, group, padded // (16 * per), per, 16)  # [group, channel, block, shift, byte]
    packed = np.zeros((groups, group, padded // (16 * per), 16), np.uint8)
    for i in range(per):
        packed |= (q[..., i, :] << (bits * i)).astype(np.uint8)
    parts = [packed.reshape(groups, -1)]
    for a in (scales, biases):
        p = np.zeros((padded, groups), a.dtype)
        p[:n] = a
        parts.append(np.ascontiguousarray(p.T).view(np.uint8))
    return np.concatenate(parts, axis=1).reshape(-1)
