"""Top-k sparse attention (FlexGen §5), a named approximation: each query attends only to the
`keep` share of the keys it may see that score highest (at least one), the softmax renormalized over
those. FlexGen uses it to read a tenth of the values from the slower tier; here it is measured for
its quality cost (`python -m mlx_flash.bench perplexity --attention-keep`) and available to the throughput mode
(`Policy.attention_keep`, 1.0: exact).

`TopKAttention` wraps any member of the KV-cache protocol: the graph shows a cache its queries and
keys (`observe`) before asking for the mask, so the wrapper computes the scores there
(`ops.top_k_mask`) and hands the graph a mask of each query's top keys. It holds nothing itself.
`top_k_mask_reference` is the plain-numpy statement of what the backends compute.
"""

from __future__ import annotations

import numpy as np

from ..models.cache import LayerKV, RowsMask


def visible_reference(mask, B: int, T: int, S: int) -> np.ndarray:
    """A mask as sdpa takes it (None, "causal" aligned bottom-right, or bool [B, 1, T, S]) as bool."""
    if mask is None:
        return np.ones((1, 1, T, S), bool)
    if isinstance(mask, str):
        return (np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T))[None, None]
    if isinstance(mask, RowsMask):
        return mask.keep(T, S)
    return np.asarray(mask, bool)


def top_k_mask_reference(q: np.ndarray, k: np.ndarray, scale: float, mask, keep: float) -> np.ndarray:
    """q [B, Hq, T, hd], k [B, Hkv, S, hd] -> bool [B, Hq, T, S]: query (head h, t) keeps its
    ceil(keep x n) highest-scoring keys of the n it may see (ties at the threshold kept too)."""
    B, Hq, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    kk = np.repeat(k.astype(np.float64), Hq // Hkv, axis=1)  # head h reads kv head h // (Hq / Hkv)
    s = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), kk) * scale
    vis = np.broadcast_to(visible_reference(mask, B, T, S), (B, 1, T, S))
    s = np.where(vis, s, -np.inf)
    n = np.maximum(np.ceil(vis.sum(-1, keepdims=True) * keep), 1).astype(np.int64)  # [B, 1, T, 1]
    srt = np.sort(s, axis=-1)
    thr = np.take_along_axis(srt, np.broadcast_to(S - n, (B, Hq, T, 1)), axis=-1)
    return (s >= thr) & vis


class TopKAttention(LayerKV):
    """Any cache, its queries attending to their top `keep` share of keys (see the module docstring)."""

    def __init__(self, inner: LayerKV, keep: float):
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"attention keep must be in (0, 1] (got {keep})")
        self.inner, self.keep_share = inner, keep
        self.holds = inner.holds
        self._mask = None

    @property
    def offset(self) -> int:
        return self.inner.offset

    @property
    def capacity(self):
        return self.inner.capacity

    def update(self, ops, k, v):
        return self.inner.update(ops, k, v)

    def array(self, ops, held):
        return self.inner.array(ops, held)

    def observe(self, ops, q, keys, scale: float) -> None:
        self.inner.observe(ops, q, keys, scale)
        mask = self.inner.mask(ops, q.shape[2])
        self._mask = ops.top_k_mask(q, self.inner.array(ops, keys), scale, mask, self.keep_share)

    def attention(self, ops, q, keys, values, scale: float, mask):
        return ops.sdpa(q, self.inner.array(ops, keys), self.inner.array(ops, values), scale, mask)

    def mask(self, ops, T: int):
        return self._mask

    def positions(self):
        return self.inner.positions()

    def prefetch(self) -> None:
        self.inner.prefetch()

    def trim(self, n: int) -> None:
        self.inner.trim(n)

    def keep(self, ops, idx: list[int]) -> None:
        """A batch member's rows that stay (BlockKV, BatchKV, SpilledKV)."""
        self.inner.keep(ops, idx)

    def state(self, ops):
        return self.inner.state(ops)


def with_top_k(caches: list, keep: float) -> list:
    """Per-layer caches wrapped to attend to their top keys (keep 1.0: the caches as they are)."""
    return caches if keep >= 1.0 else [TopKAttention(c, keep) for c in caches]
