"""Plain-ops reference of the CPU attention kernel (cpu/attention.cpp): every query's masked softmax
over the keys it sees, in float64 with numpy. What the kernel must equal up to float32 rounding;
nothing on the per-token path calls it."""

from __future__ import annotations

import numpy as np


def attention_ref(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, kv_len=None, q_pos=None, table=None, window=0
) -> np.ndarray:
    """q [B, Hq, T, hd]; k, v [B, Hkv, S, hd] (row b's keys), or pools [blocks, Hkv, block_tokens, hd]
    read through table [B, max_blocks] (key j of row b: block table[b, j // block_tokens], token
    j % block_tokens). Row b holds kv_len[b] keys (default S) and its first query is at position
    q_pos[b] (default S - T); query t sees key j when j <= max(q_pos[b] + t, 0) and j < kv_len[b], and
    with window > 0 when j > q_pos[b] + t - window. Returns [B, Hq, T, hd] float64 (zeros for a query
    that sees no key)."""
    B, Hq, T, hd = q.shape
    Hkv = k.shape[1]
    if table is not None:
        bt = k.shape[2]
        S = table.shape[1] * bt
        j = np.arange(S)

        def rows(a, b):  # [Hkv, S, hd] of row b
            return a[table[b, j // bt], :, j % bt, :].transpose(1, 0, 2)
    else:
        S = k.shape[2]

        def rows(a, b):
            return a[b]

    kv_len = np.full(B, S) if kv_len is None else np.asarray(kv_len)
    q_pos = np.full(B, S - T) if q_pos is None else np.asarray(q_pos)
    out = np.zeros((B, Hq, T, hd))
    g = Hq // Hkv
    for b in range(B):
        kb, vb = rows(k, b).astype(np.float64), rows(v, b).astype(np.float64)
        for h in range(Hq):
            s = (q[b, h].astype(np.float64) * scale) @ kb[h // g].T  # [T, S]
            keys = np.arange(s.shape[1])
            seen = (keys[None, :] <= np.maximum(q_pos[b] + np.arange(T), 0)[:, None]) & (keys[None, :] < kv_len[b])
            if window > 0:
                seen &= keys[None, :] > (q_pos[b] + np.arange(T) - window)[:, None]
            s = np.where(seen, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            p = np.where(seen, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
            total = p.sum(axis=1, keepdims=True)
            out[b, h] = np.where(total > 0, (p @ vb[h // g]) / np.where(total > 0, total, 1), 0)
    return out


def coded_rows(buffer, layout, coded, residual, kv_len, table=None) -> np.ndarray:
    """Every row's keys (or values) as float32 [B, Hkv, max kv_len, hd], read as the coded kernel reads
    them (cpu/attention.cpp mf_attention_coded): key j of row b from the codes (layout: a
    kv_codes.CodedLayout over `buffer`; blocks named by table [B, max_blocks] when given, else row b)
    when j < coded[b], else residual [B, Hkv, R, hd] at token j - coded[b]."""
    B, H, _, hd = residual.shape
    S = int(max(kv_len)) if len(kv_len) else 0
    if table is None:
        blocks, tokens = B, int(max(coded)) if len(coded) else 0
    else:
        blocks, tokens = int(table.max()) + 1, layout.block_tokens
    full = layout.dequantize(buffer, blocks, H, tokens, hd) if blocks and tokens else None
    out = np.zeros((B, H, S, hd), np.float32)
    for b in range(B):
        for j in range(int(kv_len[b])):
            if j < coded[b]:
                blk, t = (b, j) if table is None else (int(table[b, j // tokens]), j % tokens)
                out[b, :, j] = full[blk, :, t]
            else:
                out[b, :, j] = residual[b, :, j - coded[b]]
    return out
