"""The chunked member of the KV-cache protocol (models/cache.py): one sequence's KV as a list of
chunk slots of a ChunkPool, read in place by the graph through its explicit cache argument.

ChunkTable is a sequence's chunk list (slot per chunk, None while a chunk is not in memory) and its
token count; ChunkedKV is one layer's view of it that the graph calls. Writing token t of layer l
puts it in row slot(t // C) * C + t % C of the pool's layer-l arrays. Attention reads the held
tokens where they lie, through the sequence's slot table (ops.sdpa_slots, the attention kernel's
slot-table form), the same keys in the same order as a contiguous cache's. update() still returns
the held rows gathered in order (a plain slice when the slots happen to be consecutive; on MLX a
lazy gather nothing evaluates unless a mask the kernel cannot apply or compression's attention mass
asks for it), since a padded batch of prompt chunks (BatchKV) concatenates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..backends.slot_attention import gathered_rows
from ..batching.batch_cache import BatchKV
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
        self._table = None  # (slots, int32 numpy [1, chunks]) of the last attention

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
        if any(s is None for s in self.slots[: self.chunks_for(start)]):
            raise RuntimeError("a chunk of this sequence is not in memory")
        return [ChunkedKV(self, layer, start) for layer in range(self.pool.shape.layers)]

    def rows(self, start: int, end: int):
        """Pool rows of tokens [start, end): a slice when they are consecutive, else an index array."""
        first = start // self.chunk_tokens  # only the chunks [start, end) touches: a decode step's write is one row
        base = first * self.chunk_tokens
        rows = self.pool.rows(self.slots[first : self.chunks_for(end)], end - base)[start - base :]
        if rows.size and bool(np.all(np.diff(rows) == 1)):  # every step, not just the ends: [0, 10, 2] is no run
            return slice(int(rows[0]), int(rows[-1]) + 1)
        return self.pool.ops.index(rows)

    def fetch_index(self, n_tokens: int):
        """rows(0, n_tokens), built once per forward pass and shared by the layers."""
        key = (n_tokens, tuple(self.slots))
        if self._index is None or self._index[0] != key:
            self._index = (key, self.rows(0, n_tokens))
        return self._index[1]

    def slot_table(self, n_tokens: int) -> np.ndarray:
        """The slots of the chunks holding the first n_tokens tokens, as attention's slot table
        (int32 [1, chunks]), built once per forward pass and shared by the layers."""
        key = tuple(self.slots[: self.chunks_for(n_tokens)])
        if self._table is None or self._table[0] != key:
            self._table = (key, np.array([key], np.int32))
        return self._table[1]


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
        if isinstance(idx, slice):
            return keys[:, idx, :][None], values[:, idx, :][None]
        return ops.take_tokens(keys, idx)[None], ops.take_tokens(values, idx)[None]

    def trim(self, n: int) -> None:
        self._check_trim(n)
        self.offset -= n

    def attention(self, ops, q, keys, values, scale: float, mask):
        """Over the pool where it lies (ops.sdpa_slots: the keys update() returned are a gather the
        kernel does not need), unless the graph combined the mask with one of its own (Gemma 3's
        sliding window), which the gathered keys take."""
        if mask is not None and not isinstance(mask, str):
            return ops.sdpa(q, keys, values, scale, mask)
        t, pool = self.table, self.table.pool
        return ops.sdpa_slots(
            q, pool.keys[self.layer], pool.values[self.layer], scale, t.chunk_tokens, t.slot_table(self.offset),
            np.array([self.offset], np.int32), np.array([self.offset - q.shape[2]], np.int32),
        )  # fmt: skip

    def observe(self, ops, q, keys, scale: float) -> None:
        density = self.table.density
        if density is not None:  # one host read per layer: the price of measuring, compression only
            density.add(ops.to_numpy(ops.attention_columns(q, keys, scale)), q.shape[2], q.shape[1])

    def state(self, ops):
        idx = self.table.fetch_index(self.offset)
        pool = self.table.pool
        # copies: a backend's numpy view would change with the pool
        return (
            np.array(ops.to_numpy(pool.keys[self.layer][:, idx, :]))[None],
            np.array(ops.to_numpy(pool.values[self.layer][:, idx, :]))[None],
        )


@dataclass(frozen=True)
class HeldRows:
    """The keys (or values) a chunked batch's update returns: one pool layer and the rows the step's
    sequences hold there, [B, Hkv, S, hd] as `shape` says, gathered only where something needs them
    as one array (a mask the graph combined with its own, attention mass for compression)."""

    pool: Any  # the pool's layer array [Hkv, slots * C, hd]
    held: Any  # backend index of every row's held tokens, right-padded to S with pool row 0: [B * S]
    shape: tuple  # (B, Hkv, S, hd)

    def gather(self, ops):
        return gathered_rows(ops, self.pool, self.held, self.shape[0], self.shape[2])


class ChunkedBatchKV(BatchKV):
    """One layer of several sequences' chunked caches in one pool, run as one batch (the server's
    continuous batching): a step scatters every row's new keys with one indexed write, and attention
    reads every row's chunks where they lie through a slot table with each row's length
    (ops.sdpa_slots), no gathered copy of any row's keys. BatchKV over the same rows gathers each row
    apart, then pads and concatenates: B reads and a copy of everything per layer and step. Each row
    attends over the keys and values it holds alone, so attention computes what it would alone. The
    layers of one step share their pool rows and slot table (`StepRows`): the tables are the same for
    every layer, so they are worked out once per step. Positions, mask and the rest are BatchKV's."""

    holds = ChunkedKV.holds

    def __init__(self, rows: list[ChunkedKV], step: "StepRows | None" = None):
        super().__init__(rows)
        pool, layer = rows[0].table.pool, rows[0].layer
        if any(r.table.pool is not pool or r.layer != layer for r in rows):
            raise ValueError("a chunked batch's rows share one pool and one layer")
        self.pool, self.layer = pool, layer
        self.step = step or StepRows()
        self._lengths = np.array([r.offset for r in rows], np.int64)
        self._mask = None

    def update(self, ops, k, v):
        B, H, T, D = k.shape
        rows = self.step.rows(ops, self.rows, T)
        for r in self.rows:
            r.offset += T
        keys, values = self.pool.keys[self.layer], self.pool.values[self.layer]
        keys[:, rows.new, :] = ops.reshape(ops.transpose(k, (1, 0, 2, 3)), (H, B * T, D))
        values[:, rows.new, :] = ops.reshape(ops.transpose(v, (1, 0, 2, 3)), (H, B * T, v.shape[3]))
        self._lengths = np.array([r.offset for r in self.rows], np.int64)
        return HeldRows(keys, rows.held, (B, H, rows.S, D)), HeldRows(values, rows.held, (B, H, rows.S, v.shape[3]))

    def mask(self, ops, T: int):
        """BatchKV's mask, remembered: attention applies it through each row's length, and only a mask
        the graph made from it (Gemma 3's sliding window) needs the gathered keys."""
        self._mask = super().mask(ops, T)
        return self._mask

    def attention(self, ops, q, keys: HeldRows, values: HeldRows, scale: float, mask):
        if mask is not self._mask:
            return ops.sdpa(q, keys.gather(ops), values.gather(ops), scale, mask)
        s = self.step.current
        return ops.sdpa_slots(q, keys.pool, values.pool, scale, self.pool.shape.tokens, s.table, s.kv_len, s.q_pos)

    def observe(self, ops, q, keys: HeldRows, scale: float) -> None:
        if any(r.table.density is not None for r in self.rows):  # compression measures attention mass
            super().observe(ops, q, keys.gather(ops), scale)


@dataclass(frozen=True)
class StepPoolRows:
    """Where one batched step's rows lie in the pool."""

    new: Any  # backend index of the new tokens' rows, [B * T]
    held: Any  # backend index of the held tokens' rows, right-padded to S with pool row 0, [B * S]
    S: int  # the longest row's keys
    table: np.ndarray  # int32 [B, max chunks]: each row's slots (padding: slot 0, past its length)
    kv_len: np.ndarray  # int32 [B]: each row's keys after the step
    q_pos: np.ndarray  # int32 [B]: the position of each row's first new token


class StepRows:
    """The pool rows and slot table of one batched step, shared by its layers (StepPoolRows), worked
    out when the first layer asks."""

    def __init__(self):
        self._key, self.current = None, None

    def rows(self, ops, rows: list[ChunkedKV], T: int) -> StepPoolRows:
        key = (tuple(id(r.table) for r in rows), tuple(r.offset for r in rows), T)
        if key != self._key:
            pool = rows[0].table.pool
            new, ends = [], []
            for r in rows:
                t, end = r.table, r.offset + T
                t.make_writable(r.offset, end)  # a table's chunks serve every layer: once per step
                t.reserve(end)
                new.append(pool.rows(t.slots, end)[r.offset :])
                ends.append(end)
            S = max(ends)
            held = np.zeros((len(rows), S), np.int64)  # padding: pool row 0, masked
            n_chunks = [r.table.chunks_for(end) for r, end in zip(rows, ends)]
            table = np.zeros((len(rows), max(n_chunks)), np.int32)
            for b, (r, end, n) in enumerate(zip(rows, ends, n_chunks)):
                held[b, :end] = pool.rows(r.table.slots, end)
                table[b, :n] = r.table.slots[:n]
            kv_len = np.array(ends, np.int32)
            self._key = key
            self.current = StepPoolRows(
                ops.index(np.concatenate(new)), ops.index(held), S, table, kv_len, kv_len - np.int32(T)
            )
        return self.current


def chunked_batch_caches(per_sequence: list[list[ChunkedKV]]) -> list[ChunkedBatchKV]:
    """Per-layer batch caches from each sequence's per-layer chunked caches ([sequence][layer]),
    sharing one step's pool rows."""
    step = StepRows()
    return [ChunkedBatchKV([caches[i] for caches in per_sequence], step) for i in range(len(per_sequence[0]))]
