"""Float rows -> GGUF k-quant blocks (Q4_K, Q5_K, Q6_K), numpy: offline work for synthetic GGUF files
(tools/make_synthetic_gguf.py) and the block kernel's tests; the gguf package quantizes the others.

A plain round-to-nearest quantizer, not llama.cpp's (which searches scales to minimize the error):
the bytes follow ggml's layouts exactly (read back by kernels/gguf_blocks_ref.py and by llama.cpp),
the error is somewhat larger than llama.cpp's own files have."""

from __future__ import annotations

import numpy as np

QK = 256


def _f16(a: np.ndarray) -> np.ndarray:
    """[n] float -> [n, 2] uint8 of its float16."""
    return a.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and minimums -> [n, 12] bytes (the inverse of ggml's get_scale_min_k4)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.zeros((len(sc), 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _k4(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """[n, 256] -> (d, dmin, scales [n, 8], mins [n, 8], codes [n, 256]) of w = d*sc*q - dmin*m."""
    n = len(w)
    sub = w.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)
    span = (sub.max(axis=2) - lo) / (levels - 1)
    d = np.maximum(span.max(axis=1), 1e-30) / 63
    dmin = np.maximum((-lo).max(axis=1), 1e-30) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    d[d == 0], dmin[dmin == 0] = 1e-7, 1e-7  # (a row of zeros: any scale decodes to zeros)
    sc = np.clip(np.rint(span / d[:, None]), 1, 63)
    m = np.clip(np.rint(-lo / dmin[:, None]), 0, 63)
    scale, offset = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.rint((sub + offset[:, :, None]) / scale[:, :, None]), 0, levels - 1).astype(np.uint8)
    return d, dmin, sc, m, q.reshape(n, 256)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    n = len(w)
    d, dmin, sc, m, q = _k4(w, 16)
    q = q.reshape(n, 4, 2, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_f16(d), _f16(dmin), _pack_scales_k4(sc, m), qs], axis=1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    n = len(w)
    d, dmin, sc, m, q = _k4(w, 32)
    q = q.reshape(n, 4, 2, 32)
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    hi = (q >> 4).astype(np.uint8)  # bit 2c + h of byte l: sub-block 2c + h, weight l
    qh = np.zeros((n, 32), np.uint8)
    for c in range(4):
        for h in range(2):
            qh |= hi[:, c, h] << (2 * c + h)
    return np.concatenate([_f16(d), _f16(dmin), _pack_scales_k4(sc, m), qh, qs], axis=1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    n = len(w)
    sub = w.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31
    d = (np.maximum(scale.max(axis=1), 1e-30) / 127).astype(np.float16).astype(np.float32)
    d[d == 0] = 1e-7
    sc = np.clip(np.rint(scale / d[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.rint(sub / (d[:, None, None] * sc[:, :, None])) + 32, 0, 63).astype(np.uint8).reshape(n, 2, 4, 32)
    ql = np.concatenate(
        [(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4), (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2
    ).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)).reshape(
        n, 64
    )
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize_k(w: np.ndarray, kind: str) -> np.ndarray:
    """w [rows, cols] float (cols a multiple of 256) -> uint8 [rows, cols / 256 * block bytes]: each
    row's blocks one after another, as a GGUF tensor's data."""
    rows, cols = w.shape
    if cols % QK:
        raise ValueError(f"{kind} quantizes rows of a multiple of {QK} weights (got {cols})")
    blocks = QUANTIZERS[kind](np.asarray(w, np.float32).reshape(-1, QK))
    return np.ascontiguousarray(blocks.reshape(rows, -1))
