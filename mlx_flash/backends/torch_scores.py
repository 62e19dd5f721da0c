"""Attention scores computed apart from sdpa, as methods of TorchOps: the attention mass each key
receives (KV compression's information density) and each query's top keys (top-k sparse
attention). Their references: service/compression.attention_columns_ref and
offload/sparse_attention.top_k_mask_reference."""

from __future__ import annotations

from ..models.cache import RowsMask

try:
    import torch
except ImportError:  # the torch backend says what to install (TorchOps refuses to start without it)
    torch = None


def attention_columns(self, q, k, scale: float):
    """Attention mass each key receives: softmax(q k^T * scale) with the causal mask (aligned as
    sdpa's), summed over heads and queries. q [1, Hq, T, hd], k [1, Hkv, S, hd] -> [S] float32
    (KV compression's information density; reference: service/compression.py)."""
    _, Hq, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.float().reshape(Hkv, (Hq // Hkv) * T, hd)
    s = (qg @ k[0].float().transpose(1, 2)) * scale
    if T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        s = s.masked_fill(~mask.repeat(Hq // Hkv, 1)[None], float("-inf"))
    return torch.softmax(s, dim=-1).sum(dim=(0, 1))


def top_k_mask(self, q, k, scale: float, mask, keep: float):
    """Each query's top `keep` share of the keys it may see, as a bool mask [B, Hq, T, S] for sdpa
    (top-k sparse attention; reference: offload/sparse_attention.top_k_mask_reference)."""
    B, Hq, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.float().reshape(B, Hkv, (Hq // Hkv) * T, hd)
    s = ((qg @ k.float().transpose(2, 3)) * scale).reshape(B, Hq, T, S)
    if mask is None:
        vis = torch.ones(1, 1, T, S, dtype=torch.bool, device=q.device)
    elif isinstance(mask, str):
        vis = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
    elif isinstance(mask, RowsMask):
        vis = torch.from_numpy(mask.keep(T, S)).to(q.device)
    else:
        vis = mask
    s = s.masked_fill(~vis, float("-inf"))
    n = torch.clamp(torch.ceil(vis.sum(dim=-1, keepdim=True).float() * keep), min=1).long()
    thr = torch.gather(torch.sort(s, dim=-1).values, -1, (S - n).expand(B, Hq, T, 1))
    return (s >= thr) & vis
