"""The chunked member of the KV-cache protocol (models/cache.py): one sequence's KV as a list of
chunk slots of a ChunkPool, read in place by the graph through its explicit cache argument.

ChunkTable is a sequence's chunk list (slot per chunk, None while a chunk is not in memory) and its
token count; ChunkedKV is one layer's view of it that the graph calls. Writing token t of layer l
puts it in row slot(t // C) * C + t % C of the pool's layer-l arrays. Attention reads the held
tokens where they lie, through the sequence's slot table (ops.sdpa_slots, the attention kernel's
slot-table form), the same keys in the same order as a contiguous cache's; chunks compressed into
the pool's arena are read there at their width (ops.sdpa_mixed), never as a float copy. update()
returns where the held rows lie (HeldChunks); they are gathered in order (`array`, compressed chunks
dequantized) only where something needs one array: a padded batch of prompt chunks (BatchKV), a
mask the kernel cannot apply, or compression's attention mass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..backends.slot_attention import gathered_rows
from ..batching.batch_cache import BatchKV, right_padded
from ..models.cache import LayerKV
from .chunk_pool import ChunkPool, arena_unit
from .coded_chunks import CLASSES, class_layouts, floats


class ChunkTable:
    def __init__(self, pool: ChunkPool, claim: Callable[[], int] | None = None, density=None):
        self.pool = pool
        self.density = density  # a compression.DensityTracker when KV compression needs attention mass
        self.claim = claim or pool.allocate  # the service passes one that evicts other contexts first
        self.slots: list[int | None] = []
        self.tokens = 0  # tokens whose KV the chunks hold
        self.written = 0  # tokens every layer has written before the pass now writing (make_writable's start)
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

    def write_ready(self, start: int, end: int) -> None:
        """Slots for tokens [start, end) about to be written: the shared or compressed chunks among
        the held ones copied first (make_writable), then the missing ones claimed (reserve), in that
        order so a claim that compresses knows what every layer has written (kv_memory.claim)."""
        self.make_writable(start, end)
        self.reserve(end)

    def make_writable(self, start: int, end: int) -> None:
        """Chunks that tokens [start, end) will be written into and that another sequence shares
        (a fork's last shared chunk) are copied first: a shared chunk is never written in place; a
        compressed one (a context cut inside it) comes back to a float slot as what it holds."""
        pool = self.pool
        self.written = start  # (a claim may compress the chunks wholly below it: kv_memory.claim)
        for i in range(start // self.chunk_tokens, min(len(self.slots), self.chunks_for(end))):
            s = self.slots[i]
            if s is None or not (s < 0 or pool.is_shared(s)):
                continue
            new = self.claim()
            if s < 0:
                payload, bits = pool.coded_payload(s)
                pool.load([new], floats(payload, pool.shape.array_shape, bits)[None])
            else:
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

    def slot_table(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The chunks holding the first n_tokens tokens as attention's slot table and class table
        (int32 [1, chunks] each; classes None when every chunk is float: pool_entries), built once
        per forward pass and shared by the layers."""
        key = tuple(self.slots[: self.chunks_for(n_tokens)])
        if self._table is None or self._table[0] != key:
            table, classes = pool_entries(self.pool, key)
            self._table = (key, (table[None], None if classes is None else classes[None]))
        return self._table[1]

    def gather(self, ops, layer: int, n_tokens: int, values: bool):
        """Keys (or values) of the first n_tokens tokens of `layer` as one array [1, Hkv, n, hd]: a
        slice or gather of the pool, compressed chunks dequantized (a copy; attention never needs it)."""
        arr = (self.pool.values if values else self.pool.keys)[layer]
        if not any(s is not None and s < 0 for s in self.slots[: self.chunks_for(n_tokens)]):
            idx = self.fetch_index(n_tokens)
            return arr[:, idx, :][None] if isinstance(idx, slice) else ops.take_tokens(arr, idx)[None]
        C, shape, arena = self.chunk_tokens, self.pool.shape.array_shape, self.pool.arena
        sh = self.pool.shape
        out = np.empty((sh.kv_heads, self.chunks_for(n_tokens) * C, sh.head_dim), np.float32)
        by_bits: dict[int, list[int]] = {}
        for i, s in enumerate(self.slots[: self.chunks_for(n_tokens)]):
            if s < 0:
                by_bits.setdefault(arena.bits(arena_unit(s)), []).append(i)
            else:
                out[:, i * C : (i + 1) * C] = ops.to_numpy(arr[:, s * C : (s + 1) * C, :])
        for bits, idx in by_bits.items():  # one gather and dequantization per width, not per chunk
            x = arena.layer_floats([arena_unit(self.slots[i]) for i in idx], shape, bits, layer, values)
            for i, xi in zip(idx, x):
                out[:, i * C : (i + 1) * C] = xi
        return ops.array(out[None, :, :n_tokens])


def pool_entries(pool: ChunkPool, slots) -> tuple[np.ndarray, np.ndarray | None]:
    """(table, classes) int32 [chunks] of attention over `slots`: a float slot is itself, class 0; a
    chunk in the arena its unit, class CLASSES.index(bits) + 1. Classes None when all are float slots."""
    if all(s >= 0 for s in slots):
        return np.array(slots, np.int32), None
    table = np.array([s if s >= 0 else arena_unit(s) for s in slots], np.int32)
    classes = np.array([0 if s >= 0 else CLASSES.index(pool.arena.bits(arena_unit(s))) + 1 for s in slots], np.int32)
    return table, classes


def mixed_sdpa(ops, pool: ChunkPool, layer: int, q, scale: float, table, classes, kv_len, q_pos):
    """Attention over a pool layer's float chunks and its arena's compressed ones (ops.sdpa_mixed)."""
    layouts = class_layouts(pool.shape.array_shape, layer)
    return ops.sdpa_mixed(
        q, pool.keys[layer], pool.values[layer], scale, pool.shape.tokens, table, classes, pool.arena.buffer, layouts,
        kv_len, q_pos,
    )  # fmt: skip


@dataclass(frozen=True)
class HeldChunks:
    """Where a ChunkedKV's held keys (or values) lie, as its update returns them: `ChunkedKV.array`
    gathers them (ChunkTable.gather)."""

    table: ChunkTable
    layer: int
    n_tokens: int
    values: bool


class ChunkedKV(LayerKV):
    holds = "the service's KV budget holds"

    def __init__(self, table: ChunkTable, layer: int, offset: int):
        self.table, self.layer = table, layer
        self.offset = offset
        self.capacity = table.pool.capacity_tokens

    def update(self, ops, k, v):
        B, _, T, _ = k.shape
        if B != 1:
            raise ValueError(f"a chunked KV cache holds one sequence (got a batch of {B})")
        end = self.offset + T
        t, pool = self.table, self.table.pool
        t.write_ready(self.offset, end)
        new = t.rows(self.offset, end)
        keys, values = pool.keys[self.layer], pool.values[self.layer]
        keys[:, new, :] = k[0]
        values[:, new, :] = v[0]
        self.offset = end
        return HeldChunks(t, self.layer, end, False), HeldChunks(t, self.layer, end, True)

    def array(self, ops, held):
        if isinstance(held, HeldChunks):
            return held.table.gather(ops, held.layer, held.n_tokens, held.values)
        return held  # a padded batch's rows, gathered already (BatchKV.observe)

    def trim(self, n: int) -> None:
        self._check_trim(n)
        self.offset -= n

    def attention(self, ops, q, keys, values, scale: float, mask):
        """Over the pool (and its arena) where it lies, unless the graph combined the mask with one of
        its own (Gemma 3's sliding window), which the gathered keys take."""
        if mask is not None and not isinstance(mask, str):
            return ops.sdpa(q, self.array(ops, keys), self.array(ops, values), scale, mask)
        t, pool = self.table, self.table.pool
        table, classes = t.slot_table(self.offset)
        kv_len, q_pos = np.array([self.offset], np.int32), np.array([self.offset - q.shape[2]], np.int32)
        if classes is not None:
            return mixed_sdpa(ops, pool, self.layer, q, scale, table, classes, kv_len, q_pos)
        return ops.sdpa_slots(
            q, pool.keys[self.layer], pool.values[self.layer], scale, t.chunk_tokens, table, kv_len, q_pos
        )

    def observe(self, ops, q, keys, scale: float) -> None:
        """Compression's attention mass, measured over prompt passes (T > 1): a decode step's one query
        would read every compressed chunk back to floats, every step."""
        density = self.table.density
        if density is not None and q.shape[2] > 1:  # one host read per layer: the price of measuring
            columns = ops.attention_columns(q, self.array(ops, keys), scale)
            density.add(ops.to_numpy(columns), q.shape[2], q.shape[1])

    def state(self, ops):
        # copies: a backend's numpy view would change with the pool
        return tuple(
            np.array(ops.to_numpy(self.table.gather(ops, self.layer, self.offset, values))) for values in (False, True)
        )


@dataclass(frozen=True)
class HeldRows:
    """The keys (or values) a chunked batch's update returns: where the step's sequences hold them,
    [B, Hkv, S, hd] as `shape` says, gathered only where something needs them as one array (a mask
    the graph combined with its own, attention mass for compression)."""

    pool: Any  # the pool's layer array [Hkv, slots * C, hd]
    step: "StepPoolRows"
    rows: tuple  # the batch's ChunkedKV rows
    values: bool
    shape: tuple  # (B, Hkv, S, hd)

    def gather(self, ops):
        B, _, S, _ = self.shape
        if self.step.held is not None:
            return gathered_rows(ops, self.pool, self.step.held, B, S)
        # compressed chunks among them: each row gathered (dequantized), right-padded
        rows = [r.table.gather(ops, r.layer, int(n), self.values) for r, n in zip(self.rows, self.step.kv_len)]
        return ops.concatenate([right_padded(ops, g, S) for g in rows], axis=0)


class ChunkedBatchKV(BatchKV):
    """One layer of several sequences' chunked caches in one pool, run as one batch (the server's
    continuous batching): a step scatters every row's new keys with one indexed write, and attention
    reads every row's chunks where they lie through a slot table with each row's length
    (ops.sdpa_slots, or ops.sdpa_mixed where the pool's arena holds compressed chunks of a row), no
    gathered copy of any row's keys. BatchKV over the same rows gathers each row apart, then pads and
    concatenates: B reads and a copy of everything per layer and step. Each row attends over the keys
    and values it holds alone, so attention computes what it would alone. The layers of one step
    share their pool rows and slot table (`StepRows`): the tables are the same for every layer, so
    they are worked out once per step. Positions, mask and the rest are BatchKV's."""

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
        held = tuple(self.rows)
        return (
            HeldRows(keys, rows, held, False, (B, H, rows.S, D)),
            HeldRows(values, rows, held, True, (B, H, rows.S, v.shape[3])),
        )

    def array(self, ops, held):
        return held.gather(ops) if isinstance(held, HeldRows) else held

    def mask(self, ops, T: int):
        """BatchKV's mask, remembered: attention applies it through each row's length, and only a mask
        the graph made from it (Gemma 3's sliding window) needs the gathered keys."""
        self._mask = super().mask(ops, T)
        return self._mask

    def attention(self, ops, q, keys: HeldRows, values: HeldRows, scale: float, mask):
        if mask is not self._mask:
            return ops.sdpa(q, keys.gather(ops), values.gather(ops), scale, mask)
        s = self.step.current
        if s.classes is not None:
            return mixed_sdpa(ops, self.pool, self.layer, q, scale, s.table, s.classes, s.kv_len, s.q_pos)
        return ops.sdpa_slots(q, keys.pool, values.pool, scale, self.pool.shape.tokens, s.table, s.kv_len, s.q_pos)

    def observe(self, ops, q, keys: HeldRows, scale: float) -> None:
        if q.shape[2] > 1 and any(r.table.density is not None for r in self.rows):  # (as ChunkedKV.observe)
            super().observe(ops, q, keys.gather(ops), scale)


@dataclass(frozen=True)
class StepPoolRows:
    """Where one batched step's rows lie in the pool."""

    new: Any  # backend index of the new tokens' rows, [B * T]
    held: Any  # backend index of the held tokens' rows, right-padded to S with pool row 0, [B * S]; None
    # where a row holds compressed chunks (they are not pool rows)
    S: int  # the longest row's keys
    table: np.ndarray  # int32 [B, max chunks]: each row's slots (padding: slot 0, past its length)
    classes: np.ndarray | None  # int32 [B, max chunks]: each chunk's class (pool_entries), None: all float
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
            C = pool.shape.tokens
            new, ends = [], []
            for r in rows:
                t, end = r.table, r.offset + T
                t.write_ready(r.offset, end)  # a table's chunks serve every layer: once per step
                first = r.offset // C  # the chunks the new tokens touch: float ones
                new.append(pool.rows(t.slots[first : t.chunks_for(end)], end - first * C)[r.offset - first * C :])
                ends.append(end)
            S = max(ends)
            n_chunks = [r.table.chunks_for(end) for r, end in zip(rows, ends)]
            table = np.zeros((len(rows), max(n_chunks)), np.int32)
            classes = np.zeros_like(table)
            for b, (r, n) in enumerate(zip(rows, n_chunks)):
                table[b, :n], c = pool_entries(pool, r.table.slots[:n])
                if c is not None:
                    classes[b, :n] = c
            held = None
            if not classes.any():
                held = np.zeros((len(rows), S), np.int64)  # padding: pool row 0, masked
                for b, (r, end) in enumerate(zip(rows, ends)):
                    held[b, :end] = pool.rows(r.table.slots, end)
                held = ops.index(held)
            kv_len = np.array(ends, np.int32)
            self._key = key
            self.current = StepPoolRows(
                ops.index(np.concatenate(new)), held, S, table, classes if classes.any() else None, kv_len,
                kv_len - np.int32(T),
            )  # fmt: skip
        return self.current


def chunked_batch_caches(per_sequence: list[list[ChunkedKV]]) -> list[ChunkedBatchKV]:
    """Per-layer batch caches from each sequence's per-layer chunked caches ([sequence][layer]),
    sharing one step's pool rows."""
    step = StepRows()
    return [ChunkedBatchKV([caches[i] for caches in per_sequence], step) for i in range(len(per_sequence[0]))]
