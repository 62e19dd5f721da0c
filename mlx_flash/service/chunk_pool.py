"""KV chunk slots and their free list (the allocator every chunked cache draws from).

A chunk is C consecutive tokens of one sequence, all layers. The pool holds up to `n_slots` chunk
slots: per layer one keys and one values array [Hkv, held_slots * C, hd] in the activation dtype, so
slot s of layer l is tokens [s*C, (s+1)*C) along axis 1. Allocated whole at the start (its bytes
count from the start), or, where the memory limit leaves room for it (`grows`), as slots are taken:
the arrays double from one slot and, once past a quarter of n_slots, go straight to n_slots, so a
short conversation holds a few chunks and growing never holds more than 1.25 x the whole pool (the
old arrays beside the new while they are copied).
A sequence's attention reads its slots where they lie through a slot table (ChunkedKV,
ops.sdpa_slots), and a slot's bytes are exported and imported whole for swap files. Slots are
recycled through a free list; the pool never grows past n_slots.

Compressed chunks (an option, service/compression.py) leave the float slots for an arena beside
them (coded_chunks.CodedArena) holding the bytes their swap file holds; a chunk slot is then
`coded_slot(unit)`, a negative number, and share, release and is_shared take either kind.

Question-named methods, as a block manager has: can_allocate(n), allocate(), release(slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import MemoryBudgetError
from .coded_chunks import RAW, CodedArena, packed_bytes


def coded_slot(unit: int) -> int:
    """The slot number of a compressed chunk at arena unit `unit` (negative: float slots are >= 0)."""
    return -unit - 1


def arena_unit(slot: int) -> int:
    return -slot - 1


@dataclass(frozen=True)
class ChunkShape:
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int  # C

    @property
    def token_bytes(self) -> int:
        """Keys and values of one token, every layer, float32 (as swap files hold them)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 4

    @property
    def nbytes(self) -> int:
        """One chunk in float32: [layers, 2, Hkv, C, hd]."""
        return self.tokens * self.token_bytes

    @property
    def array_shape(self) -> tuple:
        return (self.layers, 2, self.kv_heads, self.tokens, self.head_dim)


class ChunkPool:
    def __init__(self, ops, shape: ChunkShape, n_slots: int, grows: bool = False, coded_bytes: int = 0):
        if n_slots < 1:
            raise MemoryBudgetError(
                f"a KV budget of {n_slots} chunks holds nothing; it needs at least one chunk "
                f"({shape.nbytes / 1e6:.2f} MB)"
            )
        self.ops, self.shape, self.n_slots = ops, shape, n_slots
        self._like = ops.array(np.zeros(1, np.float32))  # the activation dtype
        self.keys, self.values = [], []
        self.held_slots = 0
        self._grow(1 if grows else n_slots)  # one slot at least: a padded batch's rows point at row 0
        self._free = list(range(n_slots - 1, -1, -1))  # pop() hands out low slots first
        self._refs = [0] * n_slots  # sequences holding each slot (forked contexts share full chunks)
        self.arena = CodedArena(ops, coded_bytes) if coded_bytes else None  # compressed chunks

    def _grow(self, slots: int) -> None:
        """Arrays of `slots` slots, the held slots' rows copied into them."""
        sh = self.shape
        rows, dims = self.held_slots * sh.tokens, (sh.kv_heads, slots * sh.tokens, sh.head_dim)
        for arrays in (self.keys, self.values):
            for layer in range(self.shape.layers):
                new = self.ops.zeros(dims, like=self._like)
                if rows:
                    new[:, :rows, :] = arrays[layer][:, :rows, :]
                    arrays[layer] = new
                else:
                    arrays.append(new)
                self.ops.materialize(new)  # one layer at a time: the old one goes before the next is made
        self.held_slots = slots

    def _hold(self, slot: int) -> None:
        if slot >= self.held_slots:
            doubled = max(slot + 1, 2 * self.held_slots)
            self._grow(self.n_slots if doubled > self.n_slots // 4 else doubled)

    # ---- the allocator --------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        if not self._free:
            raise MemoryBudgetError(f"all {self.n_slots} KV chunk slots are in use")
        slot = self._free.pop()
        self._hold(slot)
        self._refs[slot] = 1
        return slot

    def share(self, slot: int) -> int:
        """One more sequence holds `slot` (a fork): it stays until every holder released it."""
        if slot < 0:
            self._coded().share(arena_unit(slot))
            return slot
        self._check(slot)
        self._refs[slot] += 1
        return slot

    def is_shared(self, slot: int) -> bool:
        if slot < 0:
            return self._coded().is_shared(arena_unit(slot))
        return self._refs[slot] > 1

    def release(self, slot: int) -> bool:
        """Drop one holder of `slot`; returns whether the slot (a float one: the arena's bytes are
        counted apart) became free."""
        if slot < 0:
            self._coded().release(arena_unit(slot))
            return False
        self._check(slot)
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._free.append(slot)
            return True
        return False

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots or self._refs[slot] == 0:
            raise ValueError(f"KV chunk slot {slot} is not allocated")

    @property
    def capacity_tokens(self) -> int:
        """Most tokens one sequence can hold: every float slot, and the arena's room at 8 bits."""
        coded = self.arena.nbytes // self.coded_bytes(8) if self.arena else 0
        return (self.n_slots + coded) * self.shape.tokens

    # ---- compressed chunks ---------------------------------------------------------------------
    def _coded(self) -> CodedArena:
        if self.arena is None:
            raise ValueError("this pool holds no compressed chunks")
        return self.arena

    def coded_bytes(self, bits: int) -> int:
        return packed_bytes(self.shape.array_shape, bits)

    def can_hold_coded(self, bits: int) -> bool:
        return self.arena is not None and self.arena.can_hold(self.coded_bytes(bits))

    def place_coded(self, payload: np.ndarray, bits: int) -> int:
        """A chunk's bytes into the arena (uint8: coded_chunks.encode's, or float32 at bits RAW);
        returns its slot."""
        return coded_slot(self._coded().place(payload[: self.coded_bytes(bits)], bits))

    def width(self, slot: int) -> int:
        """Bits a chunk slot holds its chunk at: 0 for float (a float slot, or RAW in the arena)."""
        if slot >= 0:
            return 0
        bits = self._coded().bits(arena_unit(slot))
        return 0 if bits == RAW else bits

    def coded_payload(self, slot: int) -> tuple[np.ndarray, int]:
        """(a copy of an arena chunk's bytes, its bits: 8, 4, 2 or RAW)."""
        arena, unit = self._coded(), arena_unit(slot)
        bits = arena.bits(unit)
        return arena.read(unit, self.coded_bytes(bits)), bits

    def copy(self, src: int, dst: int) -> None:
        """Slot dst gets slot src's keys and values (copy on write of a shared chunk)."""
        C = self.shape.tokens
        for arr in self.keys + self.values:
            arr[:, dst * C : (dst + 1) * C, :] = arr[:, src * C : (src + 1) * C, :]

    @property
    def nbytes(self) -> int:
        """What the pool holds now as the backend keeps it (activation dtype), with the arena."""
        return sum(int(a.nbytes) for a in self.keys + self.values) + (self.arena.nbytes if self.arena else 0)

    # ---- token rows -----------------------------------------------------------------------------
    def rows(self, slots, n_tokens: int) -> np.ndarray:
        """Row numbers along axis 1 of the first n_tokens tokens of a sequence whose chunks are `slots`."""
        C = self.shape.tokens
        base = np.asarray(slots, dtype=np.int64)[:, None] * C + np.arange(C, dtype=np.int64)
        return base.reshape(-1)[:n_tokens]

    # ---- whole chunks, for swap files -----------------------------------------------------------
    def export(self, slots) -> np.ndarray:
        """The chunks in `slots` as float32 numpy [n, layers, 2, Hkv, C, hd] (one host read per layer)."""
        sh = self.shape
        idx = self.ops.index(self.rows(slots, len(slots) * sh.tokens))
        out = np.empty((len(slots),) + sh.array_shape, np.float32)
        for layer in range(sh.layers):
            for j, arr in enumerate((self.keys[layer], self.values[layer])):
                rows = self.ops.to_numpy(arr[:, idx, :])  # [Hkv, n*C, hd]
                out[:, layer, j] = rows.reshape(sh.kv_heads, len(slots), sh.tokens, sh.head_dim).transpose(1, 0, 2, 3)
        return out

    def load(self, slots, data: np.ndarray) -> None:
        """Write chunks `data` [n, layers, 2, Hkv, C, hd] into `slots`."""
        sh = self.shape
        if data.shape != (len(slots),) + sh.array_shape:
            raise ValueError(f"chunk data of shape {data.shape} does not fit {len(slots)} slots of {sh.array_shape}")
        idx = self.ops.index(self.rows(slots, len(slots) * sh.tokens))
        for layer in range(sh.layers):
            for arr, j in ((self.keys[layer], 0), (self.values[layer], 1)):
                rows = np.ascontiguousarray(data[:, layer, j].transpose(1, 0, 2, 3)).reshape(
                    sh.kv_heads, -1, sh.head_dim
                )
                arr[:, idx, :] = self.ops.array(rows)
        self.ops.materialize(*self.keys, *self.values)
