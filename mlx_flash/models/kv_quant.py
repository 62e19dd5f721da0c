"""Group-wise affine quantization of KV (numpy): what the KV caches that hold codes share, the
service's compressed chunks (service/compression.py) and the throughput mode's 4-bit rows
(offload/quantized_kv.py). Each group of `group` values along the last axis keeps a float16 scale and
bias (x ~ codes * scale + bias, min..max); codes are packed into bytes, value j of a byte at bits * j."""

from __future__ import annotations

import numpy as np


def quantize(x: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [..., hd] float32 -> (codes packed into uint8 [..., hd * bits / 8], scales, biases float16
    [..., hd / group]): affine per group, x ~ codes * scale + bias."""
    *lead, hd = x.shape
    if hd % group or (group * bits) % 8:
        raise ValueError(f"head dim {hd} does not split into groups of {group} at {bits} bits")
    g = x.reshape(*lead, hd // group, group).astype(np.float32)
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(np.float16)
    bias = lo.astype(np.float16)
    s32 = scale.astype(np.float32)
    codes = np.where(s32 > 0, np.rint((g - bias.astype(np.float32)) / np.where(s32 > 0, s32, 1)), 0)
    codes = np.clip(codes, 0, levels).astype(np.uint8).reshape(*lead, hd)
    per = 8 // bits
    c = codes.reshape(*lead, hd // per, per)
    packed = np.zeros((*lead, hd // per), np.uint8)
    for j in range(per):
        packed |= (c[..., j] << (bits * j)).astype(np.uint8)
    return packed, scale[..., 0], bias[..., 0]


def dequantize(
    packed: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int, group: int, out: np.ndarray | None = None
) -> np.ndarray:
    """The inverse of quantize: codes [..., n] (uint8) with scale and bias [..., n * 8 / bits / group]
    -> float32 [..., n * 8 / bits], written into `out` when given (any float32 view of that shape:
    a transposed chunk's keys land in place). Two passes over the floats (code x scale, + bias) and
    none over a float copy of the codes."""
    per = 8 // bits
    *lead, n = packed.shape
    if out is None:
        out = np.empty((*lead, n * per), np.float32)
    if out.shape != (*lead, n * per) or out.dtype != np.float32:
        raise ValueError(f"dequantize into {out.dtype} {out.shape}: float32 {(*lead, n * per)} expected")
    codes = _unpack(packed, bits).reshape(*lead, n * per // group, group)
    # the last axis split in two: always a view of out, never a copy (a strided view too; NumPy 2.5
    # deprecates setting .shape, which said the same)
    *s, step = out.strides
    dst = np.lib.stride_tricks.as_strided(out, (*lead, n * per // group, group), (*s, step * group, step))
    np.multiply(codes, scale.astype(np.float32)[..., None], out=dst)  # uint8 x float32: float32, exactly
    np.add(dst, bias.astype(np.float32)[..., None], out=dst)
    return out


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Codes one a byte (uint8 [..., n * 8 / bits]) from codes packed 8 / bits a byte."""
    per = 8 // bits
    if per == 1:
        return packed
    codes = np.empty((*packed.shape, per), np.uint8)
    mask = np.uint8((1 << bits) - 1)
    for j in range(per):
        np.bitwise_and(packed >> np.uint8(bits * j), mask, out=codes[..., j])
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)
