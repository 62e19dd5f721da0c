"""The chunked member of the KV-cache protocol (models/cache.py): one sequence's KV as a list of
chunk slots of a ChunkPool, read in place by the graph through its explicit cache argument.

ChunkTable is a sequence's chunk list (slot per chunk, None while a chunk is not in memory) and its
token count; ChunkedKV is one layer's view of it that the graph calls. Writing token t of layer l
puts it in row slot(t // C) * C + t % C of the pool's layer-l arrays; fetching gathers the rows of
the held tokens in order, which is a plain slice when the slots happen to be consecutive. The
gathered keys and values equal a contiguous cache's, so attention computes the same numbers.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..models.cache import LayerKV
from .chunk_pool import ChunkPool


class ChunkTable:
    def __init__(self, pool: ChunkPool, claim: Callable[[], int] | None = None, density=None):
        self.pool = pool
        self.density = density  # a compression.DensityTracker when KV compression needs attention mass
        self.claim = claim or pool.allocate  # the service passes one that evicts other contexts first
        self.slots: list[int | None] = []
        self.tokens = 0  # tokens whose KV the chunks hold
        self._index = None  # (n_tokens, slots, backend index or slice) of the last fetch

    @property
    def chunk_tokens(self) -> int:
        return self.pool.shape.tokens

    def chunks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.chunk_tokens)

    def resident(self) -> bool:
        return all(s is not None for s in self.slots)

    def reserve(self, n_tokens: int) -> None:
        """Slots for every chunk the first n_tokens tokens touch."""
        while len(self.slots) < self.chunks_for(n_tokens):
            self.slots.append(self.claim())

    def make_writable(self, start: int, end: int) -> None:
        """Chunks that tokens [start, end) will be written into and that another sequence shares
        (a fork's last shared chunk) are copied first: a shared chunk is never written in place."""
        pool = self.pool
        for i in range(start // self.chunk_tokens, min(len(self.slots), self.chunks_for(end))):
            s = self.slots[i]
            if s is not None and pool.is_shared(s):
                new = self.claim()
                pool.copy(s, new)
                pool.release(s)
                self.slots[i] = new

    def truncate(self, n_tokens: int) -> list[int]:
        """Keep the first n_tokens tokens; returns the in-memory slots of the chunks dropped."""
        keep = self.chunks_for(n_tokens)
        dropped = [s for s in self.slots[keep:] if s is not None]
        del self.slots[keep:]
        self.tokens = min(self.tokens, n_tokens)
        self._index = None
        for s in dropped:
            self.pool.release(s)
        return dropped

    def caches(self, start: int | None = None) -> list["ChunkedKV"]:
        """One view per layer, positioned after the held tokens, or at `start` (recomputing chunks
        from there: the chunks before it must be in memory)."""
        start = self.tokens if start is None else start
        if any(s is None for s in self.slots[:self.chunks_for(start)]):
            raise RuntimeError("a chunk of this sequence is not in memory")
        return [ChunkedKV(self, l, start) for l in range(self.pool.shape.layers)]

    def rows(self, start: int, end: int):
        """Pool rows of tokens [start, end): a slice when they are consecutive, else an index array."""
        first = start // self.chunk_tokens  # only the chunks [start, end) touches: a decode step's write is one row
        base = first * self.chunk_tokens
        rows = self.pool.rows(self.slots[first:self.chunks_for(end)], end - base)[start - base:]
        if rows.size and bool(np.all(np.diff(rows) == 1)):  # every step, not just the ends: [0, 10, 2] is no run
            return slice(int(rows[0]), int(rows[-1]) + 1)
        return self.pool.ops.index(rows)

    def fetch_index(self, n_tokens: int):
        """rows(0, n_tokens), built once per forward pass and shared by the layers."""
        key = (n_tokens, tuple(self.slots))
        if self._index is None or self._index[0] != key:
            self._index = (key, self.rows(0, n_tokens))
        return self._index[1]


class ChunkedKV(LayerKV):
    holds = "the service's KV budget holds"

    def __init__(self, table: ChunkTable, layer: int, offset: int):
        self.table, self.layer = table, layer
        self.offset = offset
        self.capacity = table.pool.n_slots * table.chunk_tokens

    def update(self, ops, k, v):
        B, _, T, _ = k.shape
        if B != 1:
            raise ValueError(f"a chunked KV cache holds one sequence (got a batch of {B})")
        end = self.offset + T
        t, pool = self.table, self.table.pool
        t.make_writable(self.offset, end)
        t.reserve(end)
        new = t.rows(self.offset, end)
        keys, values = pool.keys[self.layer], pool.values[self.layer]
        keys[:, new, :] = k[0]
        values[:, new, :] = v[0]
        self.offset = end
        idx = t.fetch_index(end)
        return keys[:, idx, :][None], values[:, idx, :][None]

    def trim(self, n: int) -> None:
        self._check_trim(n)
        self.offset -= n

    def observe(self, ops, q, keys, scale: float) -> None:
        density = self.table.density
        if density is not None:  # one host read per layer: the price of measuring, compression only
            density.add(ops.to_numpy(ops.attention_columns(q, keys, scale)), q.shape[2], q.shape[1])

    def state(self, ops):
        idx = self.table.fetch_index(self.offset)
        pool = self.table.pool
        # copies: a backend's numpy view would change with the pool
        return (np.array(ops.to_numpy(pool.keys[self.layer][:, idx, :]))[None],
                np.array(ops.to_numpy(pool.values[self.layer][:, idx, :]))[None])

