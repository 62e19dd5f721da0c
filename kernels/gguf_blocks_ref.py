"""Plain-ops reference of GGUF's block quantizations (numpy): the block types the store keeps as the
file has them (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; layouts in cpu/gguf_blocks.h), their sizes, and their
dequantization to float32, equal bit for bit to the gguf package's (tests/kernels/test_blockmatmul.py).
Every product is exact in float32; the one rounding is Q5_1's + m and the K types' - dmin * m."""

from __future__ import annotations

import numpy as np

from mlx_flash.quant_spec import BLOCKS, GgufBlock

__all__ = ["BLOCKS", "GgufBlock", "dequantize", "block_matmul_ref"]


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (the float16 they hold, widened exactly)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[..., count/8] uint8 -> [..., count] of bit i (little-endian within each byte)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _q5(b: np.ndarray, with_min: bool) -> np.ndarray:
    d = _f16(b[:, 0:2])[:, None]
    at = 4 if with_min else 2
    hi = _bits(b[:, at : at + 4], 32).astype(np.int32) << 4
    qs = b[:, at + 4 : at + 20]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int32) | hi
    if with_min:
        return d * q.astype(np.float32) + _f16(b[:, 2:4])[:, None]
    return d * (q - 16).astype(np.float32)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 12] packed scales -> ([n, 8] scales, [n, 8] minimums), 6 bits each."""
    s = s.astype(np.int32)
    sc = np.empty((len(s), 8), np.int32)
    m = np.empty((len(s), 8), np.int32)
    sc[:, :4], m[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, m


def _k4(b: np.ndarray, fifth_bit: bool) -> np.ndarray:
    n = len(b)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, m = _scale_min_k4(b[:, 4:16])
    qs = b[:, 48:176] if fifth_bit else b[:, 16:144]
    qs = qs.reshape(n, 4, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    q = np.stack([qs & 0xF, qs >> 4], axis=2).astype(np.int32)  # [n, 4, 2, 32]
    if fifth_bit:
        qh = b[:, 16:48].astype(np.int32)  # bit 2c + h of byte l: sub-block 2c + h, weight l
        shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :])[None, :, :, None]
        q |= ((qh[:, None, None, :] >> shift) & 1) << 4
    q = q.reshape(n, 8, 32).astype(np.float32)
    return ((d * sc.astype(np.float32))[:, :, None] * q - (dmin * m.astype(np.float32))[:, :, None]).reshape(n, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 64).astype(np.int32)
    qh = b[:, 128:192].reshape(n, 2, 32).astype(np.int32)
    sc = b[:, 192:208].view(np.int8).reshape(n, 2, 8).astype(np.float32)
    d = _f16(b[:, 208:210])[:, None, None]
    lo = np.concatenate([ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = ((lo | (hi << 4)) - 32).astype(np.float32)  # [n, 2, 128]: half, then 4 runs of 32
    scale = np.repeat(d * sc, 16, axis=2)  # sub-block of 16: run r, l // 16 -> scale 2r + l // 16
    return (scale * q).reshape(n, 256)


def dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    """raw: uint8 [..., row bytes] (rows of blocks as the file has them) -> float32 [..., weights]."""
    blk = BLOCKS[kind]
    lead = raw.shape[:-1]
    b = np.ascontiguousarray(raw).reshape(-1, blk.nbytes)
    if kind in ("Q5_0", "Q5_1"):
        out = _q5(b, kind == "Q5_1")
    elif kind in ("Q4_K", "Q5_K"):
        out = _k4(b, kind == "Q5_K")
    else:
        out = _q6_k(b)
    return out.reshape(*lead, raw.shape[-1] // blk.nbytes * blk.weights)


def block_matmul_ref(x: np.ndarray, raw: np.ndarray, kind: str) -> np.ndarray:
    """x [T, K] @ W^T with W [N, K] given as its rows of blocks: float64 accumulation."""
    return x.astype(np.float64) @ dequantize(raw, kind).astype(np.float64).T
