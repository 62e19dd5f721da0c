"""B sequences of different lengths run as one batch: `BatchKV`, a member of the KV-cache protocol
(models/cache.py) made of one cache per sequence.

Each row keeps its own cache (a `KVCache`, a service context's `ChunkedKV`, ...), so a sequence's
keys and values are exactly what it would hold running alone, and a sequence can join or leave the
batch between steps by building a new `BatchKV` over other rows (nothing to copy or shift, unlike a
left-padded batch buffer). A step writes row b's new keys into row b, then returns every row's keys
right-padded to the longest row; `mask` hides the padding, `positions` gives each row its own RoPE
position. The padding costs one copy of the held keys per layer and step: the price of rows that
stay independent.
"""

from __future__ import annotations

import numpy as np

from .cache import LayerKV


class BatchKV(LayerKV):
    holds = "a sequence of the batch holds"

    def __init__(self, rows: list[LayerKV]):
        if not rows:
            raise ValueError("a batch needs at least one sequence")
        self.rows = list(rows)
        self._lengths = np.zeros(len(rows), np.int64)  # each row's tokens after the last update

    @property
    def offset(self) -> int:
        """The longest row's tokens (the bound a step's new tokens are checked against)."""
        return max(r.offset for r in self.rows)

    @property
    def capacity(self) -> int | None:
        caps = [r.capacity for r in self.rows if r.capacity is not None]
        return min(caps) if caps else None

    def positions(self) -> np.ndarray:
        return np.array([r.offset for r in self.rows], np.int64)

    def update(self, ops, k, v):
        """k, v [B, Hkv, T, hd]: row b's into row b's cache; every row's keys, right-padded to S."""
        outs = [r.update(ops, k[b:b + 1], v[b:b + 1]) for b, r in enumerate(self.rows)]
        self._lengths = np.array([o[0].shape[2] for o in outs], np.int64)
        S = int(self._lengths.max())

        def padded(t):
            n = t.shape[2]
            if n == S:
                return t
            return ops.concatenate([t, ops.zeros((1, t.shape[1], S - n, t.shape[3]), like=t)], axis=2)

        if len(outs) == 1:
            return outs[0]
        return (ops.concatenate([padded(kk) for kk, _ in outs], axis=0),
                ops.concatenate([padded(vv) for _, vv in outs], axis=0))

    def mask(self, ops, T: int):
        """Row b's query t sees its own keys up to its position: key j iff j <= length_b - T + t."""
        if (self._lengths == self._lengths[0]).all():  # no padding: every row sees what it would alone
            return LayerKV.mask(self, ops, T)
        S = int(self._lengths.max())
        last = self._lengths[:, None] - T + np.arange(T)[None, :]  # [B, T]
        keep = np.arange(S)[None, None, :] <= last[:, :, None]  # [B, T, S]
        return ops.mask(keep[:, None])

    def observe(self, ops, q, keys, scale: float) -> None:
        """Each row's queries and its own (unpadded) keys."""
        for b, (r, n) in enumerate(zip(self.rows, self._lengths)):
            r.observe(ops, q[b:b + 1], keys[b:b + 1, :, :int(n)], scale)

    def trim(self, n: int) -> None:
        for r in self.rows:
            r.trim(n)

    def state(self, ops):
        raise NotImplementedError("a batch's state is its rows' states: call state() on each of BatchKV.rows")


def batch_caches(per_sequence: list[list[LayerKV]]) -> list[BatchKV]:
    """Per-layer batch caches from each sequence's per-layer caches ([sequence][layer])."""
    n_layers = len(per_sequence[0])
    return [BatchKV([caches[i] for caches in per_sequence]) for i in range(n_layers)]
