"""The KV-cache protocol, and its simplest member: one contiguous buffer per layer.

Every model graph takes a list of per-layer caches as an explicit argument and calls only what
`LayerKV` declares; no graph knows which member it was handed:

  offset           tokens this layer holds (the position of the next token)
  capacity, holds  the most tokens it may hold (None: no bound of its own) and what sets that bound,
                   words for the message that refuses more
  update(ops, k, v) -> (keys, values)
                   update-and-fetch: append k, v [B, Hkv, T, hd] after `offset` and return every held
                   key and value [B, Hkv, offset + T, hd] as backend arrays; offset grows by T
  trim(n)          forget the last n tokens (rejected speculative drafts, a shorter shared prefix)
  positions()      the position of each sequence's next token, for RoPE and learned positions: an
                   int (one sequence: `offset`), or int numpy [B] (a batch: one per row)
  mask(ops, T)     after update, the attention mask of the T new queries, as ops.sdpa takes it:
                   None or "causal" for one sequence, a RowsMask for a batch of rows right-padded to
                   the longest (each row seeing what it would alone), a boolean [B, 1, T, S] else
                   (a graph may narrow it: a WindowMask for a sliding layer of one sequence)
  attention(ops, q, keys, values, scale, mask)
                   softmax(scale q keys^T) values over what update returned, under `mask`: ops.sdpa,
                   unless the cache returned less than every held key (compressed tokens on flash,
                   models/kv_tiers.CodedTieredKV attends over them where they lie)
  observe(ops, q, keys, scale)
                   the graph shows a cache each layer's queries and all its keys after update (a
                   no-op unless the cache measures attention, as KV compression does)
  prefetch()       start bringing the held keys in for the next update (a cache on flash reads ahead
                   while another micro-batch computes; nothing to do for one in memory)
  state(ops) -> (keys, values)
                   the held keys and values as float32 numpy [B, Hkv, offset, hd], for saving and tests

Members: `KVCache` here (one sequence, one growing buffer per layer), the service's chunked
cache (mlx_flash/service/chunked_kv.py: fixed-size chunks of every layer from a preallocated pool,
swappable one chunk at a time) and `BatchKV` (batching/batch_cache.py: B sequences' caches, of any
member, run as one batch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WindowMask:
    """One sequence's causal mask over its S keys (its T queries the last T of them) in which each query
    sees only its last `window` keys, its own included: Gemma 3's sliding layers once the context is
    longer than the window. The CPU attention kernel takes the window and skips the keys before it;
    other attention takes keep()."""

    window: int

    def keep(self, T: int, S: int) -> np.ndarray:
        """The same mask as booleans [1, 1, T, S] (True: attend)."""
        pos = (S - T + np.arange(T))[:, None]
        keys = np.arange(S)[None, :]
        return ((keys <= pos) & (keys > pos - self.window))[None, None]


@dataclass(frozen=True)
class RowsMask:
    """The mask of a batch whose rows hold different numbers of keys, right-padded to the longest:
    row b holds kv_len[b] keys, its query t sits at position q_pos[b] + t and sees key j when j <=
    max(q_pos[b] + t, 0) and j < kv_len[b] (a query before position 0, a left-padded step's padding
    column, sees key 0 rather than nothing). The CPU attention kernel takes it as it is (each row then
    computes exactly what it computes alone); other attention takes keep()."""

    kv_len: np.ndarray  # int32 [B]
    q_pos: np.ndarray  # int32 [B]

    def keep(self, T: int, S: int) -> np.ndarray:
        """The same mask as booleans [B, 1, T, S] (True: attend)."""
        last = np.maximum(self.q_pos[:, None] + np.arange(T)[None, :], 0)  # [B, T]
        keys = np.arange(S)[None, None, :]
        return ((keys <= last[:, :, None]) & (keys < self.kv_len[:, None, None]))[:, None]


class LayerKV(ABC):
    """One layer's keys and values of one sequence (see the module docstring)."""

    offset: int
    capacity: int | None = None
    holds: str = ""

    @abstractmethod
    def update(self, ops, k, v):
        """Append k, v [B, Hkv, T, hd]; return all held keys and values [B, Hkv, offset, hd]."""

    @abstractmethod
    def trim(self, n: int) -> None:
        """Forget the last n tokens; their slots are overwritten by later updates."""

    def array(self, ops, held):
        """update()'s keys (or values) as one array [B, Hkv, S, hd]: what it returned, unless that was
        where they lie (a chunked cache's handles), gathered then."""
        return held

    def attention(self, ops, q, keys, values, scale: float, mask):
        """Queries [B, Hq, T, hd] over the keys and values update() returned: every held one."""
        return ops.sdpa(q, keys, values, scale, mask)

    def observe(self, ops, q, keys, scale: float) -> None:
        """Queries [B, Hq, T, hd] and every held key after update(): nothing to do by default."""

    def prefetch(self) -> None:
        """Held keys and values are in memory: nothing to read ahead."""

    def positions(self):
        """The next token's position: `offset` for one sequence."""
        return self.offset

    def mask(self, ops, T: int):
        """One sequence's T new queries see every held key up to their own position."""
        return "causal" if T > 1 else None

    @abstractmethod
    def state(self, ops):
        """(keys, values) held, as float32 numpy [B, Hkv, offset, hd]."""

    def _check_trim(self, n: int) -> None:
        if not 0 <= n <= self.offset:
            raise ValueError(f"cannot trim {n} tokens from a cache of {self.offset}")


class KVCache(LayerKV):
    """Keys/values in one preallocated buffer grown in steps of `step` tokens, so decode appends
    without reallocating every token, never past `max_tokens` (what the memory plan holds KV for)."""

    step = 256
    holds = "the memory plan holds KV for (raise --context within the memory budget)"

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = self.capacity = max_tokens
        self.keys = None
        self.values = None
        self.offset = 0

    def update(self, ops, k, v):
        B, H, T, D = k.shape
        end = self.offset + T
        if self.keys is None or end > self.keys.shape[2]:
            cap = -(-end // self.step) * self.step
            if self.max_tokens:
                cap = max(end, min(cap, self.max_tokens))
            nk, nv = ops.zeros((B, H, cap, D), like=k), ops.zeros((B, H, cap, v.shape[3]), like=v)
            if self.keys is not None:
                nk[:, :, : self.offset, :] = self.keys[:, :, : self.offset, :]
                nv[:, :, : self.offset, :] = self.values[:, :, : self.offset, :]
            self.keys, self.values = nk, nv
        self.keys = ops.write_tokens(self.keys, k, self.offset)
        self.values = ops.write_tokens(self.values, v, self.offset)
        self.offset = end
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]

    def trim(self, n: int) -> None:
        self._check_trim(n)
        self.offset -= n

    def state(self, ops):
        if self.keys is None:
            raise ValueError("an empty cache has no state")
        # copies: a backend's numpy view would change with the cache
        return (
            np.array(ops.to_numpy(self.keys[:, :, : self.offset, :])),
            np.array(ops.to_numpy(self.values[:, :, : self.offset, :])),
        )


def make_caches(n_layers: int, max_tokens: int | None = None) -> list[KVCache]:
    return [KVCache(max_tokens) for _ in range(n_layers)]
