"""B sequences of different lengths run as one batch, two members of the KV-cache protocol
(models/cache.py): `BatchKV`, made of one cache per sequence, and `BlockKV`, one buffer for all.

Both give each row its own RoPE position (`positions`), return keys right-padded to the longest
row with a `mask` hiding the padding, and drop rows that leave (`keep`).

A `BatchKV` step may also carry chunks of different lengths (several prompts prefilled together,
`new_tokens`): the step's tokens [B, T] are left-padded, row b's n_b tokens in its last n_b columns,
so every row's last token is the step's last column (the head reads it as it would alone) and the
mask's rule is unchanged; row b's cache gets only its own n_b keys, and the padding columns' queries
(whose output is dropped) see the row's first key, never nothing (a softmax over no key is NaN).

Each row keeps its own cache (a `KVCache`, a service context's `ChunkedKV`, ...), so a sequence's
keys and values are exactly what it would hold running alone, and a sequence can join or leave the
batch between steps by building a new `BatchKV` over other rows (nothing to copy or shift, unlike a
left-padded batch buffer). A step writes row b's new keys into row b, then returns every row's keys
right-padded to the longest row; `mask` hides the padding, `positions` gives each row its own RoPE
position. The padding costs one copy of the held keys per layer and step: the price of rows that
stay independent (the server's contexts, each in its own chunks).

`BlockKV` holds the rows in one preallocated buffer [B, Hkv, capacity, hd] (the throughput mode's
micro-batches, whose members stay together until they finish): a step writes each row's new keys
at its own length and hands the graph a view of the buffer, no copy; a row that leaves costs one
compaction of the buffer.
"""

from __future__ import annotations

import numpy as np

from ..models.cache import LayerKV, RowsMask


class BatchKV(LayerKV):
    holds = "a sequence of the batch holds"

    def __init__(self, rows: list[LayerKV], new_tokens=None):
        """new_tokens: each row's tokens in the next step, left-padded to the longest (None: all T)."""
        if not rows:
            raise ValueError("a batch needs at least one sequence")
        self.rows = list(rows)
        self._lengths = np.zeros(len(rows), np.int64)  # each row's tokens after the last update
        self.new_tokens = None if new_tokens is None else np.asarray(new_tokens, np.int64)
        if self.new_tokens is not None and (self.new_tokens.shape != (len(rows),) or self.new_tokens.min() < 1):
            raise ValueError(f"new_tokens must give each of the {len(rows)} rows at least one token")

    @property
    def offset(self) -> int:
        """The longest row's tokens (the bound a step's new tokens are checked against)."""
        return max(r.offset for r in self.rows)

    @property
    def capacity(self) -> int | None:
        caps = [r.capacity for r in self.rows if r.capacity is not None]
        return min(caps) if caps else None

    def positions(self) -> np.ndarray:
        """Each row's position of the step's first column (before its first token when left-padded)."""
        pos = np.array([r.offset for r in self.rows], np.int64)
        if self.new_tokens is not None:
            pos -= self.new_tokens.max() - self.new_tokens
        return pos

    def _padding(self, T: int) -> np.ndarray:
        """Each row's padding columns in a step of T tokens."""
        if self.new_tokens is None:
            return np.zeros(len(self.rows), np.int64)
        if T != int(self.new_tokens.max()):
            raise ValueError(f"a step of {T} tokens for rows of at most {int(self.new_tokens.max())}")
        return T - self.new_tokens

    def update(self, ops, k, v):
        """k, v [B, Hkv, T, hd]: row b's (its last n_b columns) into row b's cache; every row's keys,
        right-padded to S."""
        pad = self._padding(k.shape[2])
        outs = [
            r.update(ops, k[b : b + 1, :, int(p) :], v[b : b + 1, :, int(p) :])
            if p
            else r.update(ops, k[b : b + 1], v[b : b + 1])
            for b, (r, p) in enumerate(zip(self.rows, pad))
        ]
        outs = [(r.array(ops, kk), r.array(ops, vv)) for r, (kk, vv) in zip(self.rows, outs)]
        self._lengths = np.array([o[0].shape[2] for o in outs], np.int64)
        S = int(self._lengths.max())
        if len(outs) == 1:
            return outs[0]
        return (
            ops.concatenate([right_padded(ops, kk, S) for kk, _ in outs], axis=0),
            ops.concatenate([right_padded(ops, vv, S) for _, vv in outs], axis=0),
        )

    def mask(self, ops, T: int):
        """Row b's query t sees its own keys up to its position (no padding: what it would alone)."""
        return padded_mask(ops, self._lengths, T, ragged=bool(self._padding(T).any()))

    def observe(self, ops, q, keys, scale: float) -> None:
        """Each row's queries (its own columns) and its own (unpadded) keys."""
        pad = self._padding(q.shape[2])
        for b, (r, n, p) in enumerate(zip(self.rows, self._lengths, pad)):
            r.observe(ops, q[b : b + 1, :, int(p) :], keys[b : b + 1, :, : int(n)], scale)

    def prefetch(self) -> None:
        for r in self.rows:
            r.prefetch()

    def trim(self, n: int) -> None:
        for r in self.rows:
            r.trim(n)

    def keep(self, ops, idx: list[int]) -> None:
        """Only rows idx stay (in that order)."""
        self.rows = [self.rows[i] for i in idx]
        self._lengths = self._lengths[idx]

    def state(self, ops):
        raise NotImplementedError("a batch's state is its rows' states: call state() on each of BatchKV.rows")


def right_padded(ops, t, S: int):
    """One row's keys (or values) [1, Hkv, n, hd] right-padded with zeros to S tokens."""
    n = t.shape[2]
    if n == S:
        return t
    return ops.concatenate([t, ops.zeros((1, t.shape[1], S - n, t.shape[3]), like=t)], axis=2)


def padded_mask(ops, lengths: np.ndarray, T: int, ragged: bool = False):
    """The mask of right-padded rows after an update of T tokens: row b's query t sees key j iff
    j <= lengths[b] - T + t (at least key 0: a left-padded step's padding columns, `ragged`), as a
    RowsMask (the attention kernel then computes each row as it would alone); one sequence's mask
    when no row is padded."""
    if (lengths == lengths[0]).all() and not ragged:
        return "causal" if T > 1 else None
    return RowsMask(np.ascontiguousarray(lengths, np.int32), np.ascontiguousarray(lengths - T, np.int32))


class BlockKV(LayerKV):
    holds = "the block's KV buffer holds"

    def __init__(self, ops, rows: list[LayerKV], capacity: int):
        """The rows' held keys and values copied into one buffer with room for `capacity` tokens."""
        if not rows:
            raise ValueError("a batch needs at least one sequence")
        states = [r.state(ops) for r in rows]
        H, D = states[0][0].shape[1], states[0][0].shape[3]
        self.lengths = np.array([st[0].shape[2] for st in states], np.int64)
        if capacity < self.lengths.max():
            raise ValueError(f"capacity {capacity} is below a row's {self.lengths.max()} tokens")
        self.capacity = capacity
        keys = np.zeros((len(rows), H, capacity, D), np.float32)
        values = np.zeros((len(rows), H, capacity, D), np.float32)
        for b, (k, v) in enumerate(states):
            keys[b, :, : k.shape[2]], values[b, :, : v.shape[2]] = k[0], v[0]
        self.keys, self.values = ops.array(keys), ops.array(values)

    @property
    def offset(self) -> int:
        return int(self.lengths.max())

    def positions(self) -> np.ndarray:
        return self.lengths.copy()

    def update(self, ops, k, v):
        B, _, T, _ = k.shape
        L = self.lengths
        if int(L.max()) + T > self.capacity:
            raise ValueError(f"{int(L.max()) + T} tokens exceed the block's {self.capacity}")
        if (L == L[0]).all():
            self.keys[:, :, int(L[0]) : int(L[0]) + T, :] = k
            self.values[:, :, int(L[0]) : int(L[0]) + T, :] = v
        else:
            for b in range(B):
                n = int(L[b])
                self.keys[b, :, n : n + T, :] = k[b]
                self.values[b, :, n : n + T, :] = v[b]
        self.lengths = L + T
        S = int(self.lengths.max())
        return self.keys[:, :, :S, :], self.values[:, :, :S, :]

    def mask(self, ops, T: int):
        return padded_mask(ops, self.lengths, T)

    def trim(self, n: int) -> None:
        self._check_trim(n)
        self.lengths = self.lengths - n

    def keep(self, ops, idx: list[int]) -> None:
        """Only rows idx stay (in that order): one compaction of the buffer."""
        sel = ops.index(idx)
        self.keys, self.values = ops.take_rows(self.keys, sel), ops.take_rows(self.values, sel)
        self.lengths = self.lengths[idx]

    def state(self, ops):
        raise NotImplementedError("a block's rows have different lengths: read BlockKV.keys[b, :, :lengths[b]]")


def batch_caches(per_sequence: list[list[LayerKV]], new_tokens=None) -> list[BatchKV]:
    """Per-layer batch caches from each sequence's per-layer caches ([sequence][layer]); new_tokens:
    each row's tokens in a left-padded step (BatchKV)."""
    n_layers = len(per_sequence[0])
    return [BatchKV([caches[i] for caches in per_sequence], new_tokens) for i in range(n_layers)]
