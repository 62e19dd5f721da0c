"""Attention scores computed apart from sdpa, as methods of MLXOps: the attention mass each key
receives (KV compression's information density) and each query's top keys (top-k sparse
attention). Their references: service/compression.attention_columns_ref and
offload/sparse_attention.top_k_mask_reference."""

from __future__ import annotations

import mlx.core as mx

from ..models.cache import RowsMask


def attention_columns(self, q, k, scale: float):
    """Attention mass each key receives: softmax(q k^T * scale) with the causal mask (aligned as
    sdpa's), summed over heads and queries. q [1, Hq, T, hd], k [1, Hkv, S, hd] -> [S] float32
    (KV compression's information density; reference: service/compression.py)."""
    _, Hq, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.astype(mx.float32).reshape(Hkv, (Hq // Hkv) * T, hd)
    s = (qg @ k[0].astype(mx.float32).transpose(0, 2, 1)) * scale
    if T > 1:
        t = mx.arange(T)[:, None] + (S - T)
        mask = mx.arange(S)[None, :] <= t  # [T, S]
        s = mx.where(mx.tile(mask, (Hq // Hkv, 1))[None], s, -mx.inf)
    return mx.softmax(s, axis=-1).sum(axis=(0, 1))


def top_k_mask(self, q, k, scale: float, mask, keep: float):
    """Each query's top `keep` share of the keys it may see, as a bool mask [B, Hq, T, S] for sdpa
    (top-k sparse attention; reference: offload/sparse_attention.top_k_mask_reference)."""
    B, Hq, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.astype(mx.float32).reshape(B, Hkv, (Hq // Hkv) * T, hd)
    s = ((qg @ k.astype(mx.float32).transpose(0, 1, 3, 2)) * scale).reshape(B, Hq, T, S)
    if mask is None:
        vis = mx.ones((1, 1, T, S), dtype=mx.bool_)
    elif isinstance(mask, str):
        vis = (mx.arange(S)[None, :] <= mx.arange(T)[:, None] + (S - T))[None, None]
    elif isinstance(mask, RowsMask):
        vis = mx.array(mask.keep(T, S))
    else:
        vis = mask
    s = mx.where(vis, s, -mx.inf)
    n = mx.maximum(mx.ceil(vis.sum(axis=-1, keepdims=True).astype(mx.float32) * keep), 1).astype(mx.int32)
    thr = mx.take_along_axis(mx.sort(s, axis=-1), mx.broadcast_to(S - n, (B, Hq, T, 1)), axis=-1)
    return (s >= thr) & vis
