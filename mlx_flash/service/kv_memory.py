"""Where the contexts' chunks live, and the moves between memory and flash (LLMS §3.3-3.4).

KVMemory owns the chunk pool, the swap directory's chunk files and the reader pool. It hands out
slots (claim), frees them in LCTRU order when the pool is full (make_room: write a chunk's swap
file first unless it has a current one, or drop it under Evict.DROP; another key's chunks only
while that key holds more than its guaranteed share, quota.py), writes files ahead of time when
idle (swap_out_idle), and brings chunks back (restore.py). Compressing a chunk (an option) happens
when a call leaves its context (compress) or when it is first written, whichever comes first: its
bytes move to the pool's arena (coded_chunks.py), exactly what its swap file holds, and its float
slot is freed; the arena makes room the same way (make_arena_room). The service holds the contexts;
this module only moves their chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..errors import MemoryBudgetError
from ..store.reader_pool import ReaderPool
from .chunk_pool import ChunkPool
from .coded_chunks import RAW, encode
from .compression import Compression, choose_widths, lossy
from .context import Context
from .lifecycle import Evict, Lifecycle, Restore, eviction_order
from .quota import KeyQuota
from .restore import LoadCosts, RestoreReport, restore
from .swap_files import SwapDir, SwapError


@dataclass
class MoveCounts:
    """Chunk moves since the service started."""

    written: int = 0
    read: int = 0
    recomputed: int = 0
    evicted: int = 0
    bad_files: int = 0

    def copy(self) -> "MoveCounts":
        return replace(self)


class KVMemory:
    def __init__(
        self,
        engine,
        pool: ChunkPool,
        swap: SwapDir,
        compression: Compression,
        lifecycle: Lifecycle,
        contexts: dict[str, Context],
        save: Callable[[Context], None],
        reader_threads: int = 4,
        quota: KeyQuota = KeyQuota(),
    ):
        self.engine, self.pool, self.swap = engine, pool, swap
        self.quota = quota
        self.compression, self.lifecycle = compression, lifecycle
        self.contexts, self.save = contexts, save  # the service's contexts, and how a record is written
        # Swap files are read past the page cache where the file system allows, as a cold flash read.
        self.reader = ReaderPool(threads=reader_threads, mode=engine.config.io.mode.value)
        self.costs = LoadCosts()
        self.counts = MoveCounts()

    def claim(self, owner: str = "", table=None) -> int:
        """A free chunk slot for a context of `owner`, evicting idle contexts' chunks if none is free;
        with compression on and none to evict, the claiming context's (`table`'s) own chunks that
        every layer has written go to the arena first (a call longer than the float slots)."""
        try:
            self.make_room(1, owner)
        except MemoryBudgetError:
            ctx = next((c for c in self.contexts.values() if c.table is table), None) if table is not None else None
            if ctx is None or not self.compress(ctx, upto=table.written) or not self.pool.can_allocate():
                raise
        return self.pool.allocate()

    def make_room(self, n: int, owner: str = "") -> None:
        """Free slots until n are free for a context of `owner`, in LCTRU order, another key's chunks
        only while it holds more than its guaranteed share (quota.py); chunks without a current swap
        file are written first (dropped instead under Evict.DROP)."""
        if n <= self.pool.free_slots:
            return
        victims = []
        free = self.pool.free_slots
        held = self._held_by_owner() if self.quota.kv_share < 1.0 else {}  # (no share to guard: not counted)
        for ctx, i in eviction_order(self.contexts.values()):
            if ctx.table.slots[i] < 0:  # compressed: its arena bytes free no float slot
                continue
            if not self.quota.may_take(owner, ctx.owner, held.get(ctx.owner, 0), self.pool.n_slots):
                continue
            victims.append((ctx, i))
            if not self.pool.is_shared(ctx.table.slots[i]):
                free += 1
                if held:
                    held[ctx.owner] -= 1
            if free >= n:
                break
        if free < n:
            what = f"the KV budget ({self.pool.n_slots} chunks of {self.pool.shape.tokens} tokens)"
            if self.pool.arena is not None:
                what = (
                    f"the KV budget's float chunks ({self.pool.n_slots} of {self.pool.shape.tokens} tokens, a "
                    "quarter of it with kv_compression on, where a call writes each prefill piece)"
                )
            raise MemoryBudgetError(f"{what} cannot hold {n} more chunks: the contexts in use hold the rest")
        if self.lifecycle.evict is Evict.WHOLE_CONTEXT:  # the rest of each victim's context goes too
            ctxs = {c.id: c for c, _ in victims}
            victims = [(c, i) for c in ctxs.values() for i in c.chunks_in_memory()]
        if self.lifecycle.evict is not Evict.DROP:
            self.write(victims)  # with compression, a complete chunk moves to the arena (if it has room) and stays
        if self.lifecycle.evict is Evict.CHUNKS:
            victims = [(c, i) for c, i in victims if c.table.slots[i] >= 0]
        self._free(victims)

    def make_arena_room(self, nbytes: int, owner: str = "") -> bool:
        """Free compressed chunks (LCTRU order, written first unless current or Evict.DROP) until the
        arena holds nbytes more; False where the idle contexts' chunks do not make that room."""
        arena = self.pool.arena
        for ctx, i in eviction_order(self.contexts.values()):
            if arena.can_hold(nbytes):
                break
            if ctx.table.slots[i] >= 0 or not self.quota.may_take(owner, ctx.owner, 0, 0):
                continue  # (a key's quota counts float slots: another key's arena bytes stay its own)
            if self.lifecycle.evict is not Evict.DROP:
                self.write([(ctx, i)])
            self._free([(ctx, i)])
        return arena.can_hold(nbytes)

    def compress(self, ctx: Context, upto: int | None = None) -> int:
        """ctx's chunks held in float slots, into the arena: the complete ones compressed to the
        widths the option chooses (ctx.widths where set: a chunk recomputed after a restore), the
        last, incomplete one as its float32 values (RAW: exact, out of the float slots that the
        calls being run write); or, during a call (upto), the chunks wholly below token `upto` alone.
        Returns how many moved; a chunk the arena has no room for stays."""
        if self.pool.arena is None:
            return 0
        C, slots = self.pool.shape.tokens, ctx.table.slots
        n = ctx.kv_tokens if upto is None else upto
        ctx.widths += [0] * (len(slots) - len(ctx.widths))  # (a call's new chunks, mid-call)
        ctx.disk += [None] * (len(slots) - len(ctx.disk))
        for i, s in enumerate(slots):  # compressed chunks' widths, as the arena holds them
            if s is not None and s < 0 and self.pool.width(s):
                ctx.widths[i] = self.pool.width(s)
        idx = [i for i, s in enumerate(slots) if s is not None and s >= 0 and i * C < n]
        idx = [i for i in idx if not self.pool.is_shared(slots[i]) and (upto is None or (i + 1) * C <= upto)]
        if not idx:
            return 0
        data = self.pool.export([slots[i] for i in idx])
        widths = self._widths(ctx, dict(zip(idx, data)), n)
        moved = 0
        for j, i in enumerate(idx):
            bits = widths.get(i, ctx.widths[i]) if (i + 1) * C <= n else RAW
            if not bits:
                continue
            if not self._arena_room(bits, ctx.owner):
                continue
            payload = (
                data[j].reshape(-1).view(np.uint8) if bits == RAW else np.frombuffer(encode(data[j], bits), np.uint8)
            )
            self._to_arena(ctx, i, payload, bits)
            moved += 1
        return moved

    def _place(self, payload: np.ndarray, w: int, owner: str) -> int | None:
        """A read compressed chunk's slot in the arena, room made for it; None where none can be."""
        return self.pool.place_coded(payload, w) if self._arena_room(w, owner) else None

    def _arena_room(self, bits: int, owner: str) -> bool:
        """Whether the arena holds a chunk of `bits` now or once idle contexts' chunks made room."""
        return self.pool.can_hold_coded(bits) or self.make_arena_room(self.pool.coded_bytes(bits), owner)

    def _to_arena(self, ctx: Context, i: int, payload: np.ndarray, w: int) -> None:
        slot = self.pool.place_coded(payload, w)
        self.pool.release(ctx.table.slots[i])
        ctx.table.slots[i] = slot
        if w != RAW:
            ctx.widths[i] = w

    def _held_by_owner(self) -> dict[str, int]:
        """Slots each key's contexts hold in memory (a chunk shared by forks counted once per owner)."""
        held: dict[str, set] = {}
        for ctx in self.contexts.values():
            held.setdefault(ctx.owner, set()).update(s for s in ctx.table.slots if s is not None)
        return {o: len(s) for o, s in held.items()}

    def _free(self, chunks) -> int:
        freed = 0
        for ctx, i in chunks:
            freed += self.pool.release(ctx.table.slots[i])
            ctx.table.slots[i] = None
        self.counts.evicted += len(chunks)
        return freed

    def write(self, chunks) -> int:
        """Write swap files of the (context, chunk) pairs that have no current one; a context's
        chunks are exported together. Raises SwapError (disk full...) with every chunk still in
        memory and every file written so far recorded."""
        by_ctx: dict[str, list] = {}
        for ctx, i in chunks:
            if ctx.disk[i] is None:
                by_ctx.setdefault(ctx.id, []).append(i)
        for ctx_id, idx in by_ctx.items():
            ctx = self.contexts[ctx_id]
            coded = [i for i in idx if ctx.table.slots[i] < 0]
            idx = [i for i in idx if ctx.table.slots[i] >= 0]
            data = self.pool.export([ctx.table.slots[i] for i in idx])
            widths = self._widths(ctx, dict(zip(idx, data)))
            narrowed_slots, narrowed = [], []
            failed = True
            shape = self.pool.shape
            try:
                for i in coded:  # the arena's bytes are the file's payload (RAW ones a float32 file's)
                    payload, bits = self.pool.coded_payload(ctx.table.slots[i])
                    w = ctx.widths[i] = 0 if bits == RAW else bits  # (a fork's shared chunk: its record says so now)
                    ctx.disk[i] = self.swap.write_payload(ctx.id, i, shape, ctx.chunk_tokens(i), payload, w)
                    self.counts.written += 1
                for j, i in enumerate(idx):
                    w = widths.get(i, ctx.widths[i])
                    payload = self.swap.payload(shape, data[j], w)
                    ctx.disk[i] = self.swap.write_payload(ctx.id, i, shape, ctx.chunk_tokens(i), payload, w)
                    self.counts.written += 1
                    if w and self.pool.can_hold_coded(w):  # memory holds what the file holds, at its width
                        self._to_arena(ctx, i, payload, w)
                    elif w != ctx.widths[i]:  # (no arena, or a full one: the same values as floats)
                        ctx.widths[i] = w
                        narrowed_slots.append(ctx.table.slots[i])
                        narrowed.append(lossy(data[j], w))
                failed = False
            finally:
                if narrowed:
                    self.pool.load(narrowed_slots, np.stack(narrowed))
                try:
                    self.save(ctx)  # the files written so far are current: the record says so
                except SwapError:
                    if not failed:
                        raise  # else the chunk's own error (naming its file) is the one to report
        return sum(len(v) for v in by_ctx.values())  # (every chunk asked for: float and compressed)

    def _widths(self, ctx: Context, chunks: dict[int, np.ndarray], n_tokens: int | None = None) -> dict[int, int]:
        """Widths for the complete (of n_tokens held: ctx's, unless a call is writing), not yet
        compressed chunks among `chunks` (index -> data)."""
        C = self.pool.shape.tokens
        n_tokens = ctx.kv_tokens if n_tokens is None else n_tokens
        fresh = {i: x for i, x in chunks.items() if ctx.widths[i] == 0 and (i + 1) * C <= n_tokens}
        if not fresh or not self.compression.on:
            return {}
        n = n_tokens // C
        density = ctx.table.density.chunk_density(C, n) if ctx.table.density is not None else None
        return choose_widths(self.compression, density, {j: w for j, w in enumerate(ctx.widths[:n]) if w}, fresh)

    def restore(self, ctx: Context, n_tokens: int, how: Restore | None = None) -> RestoreReport:
        """Bring the chunks of ctx's first n_tokens into memory (ctx must be pinned)."""
        how = how or self.lifecycle.restore
        report = restore(
            self.engine,
            self.pool,
            self.swap,
            self.reader,
            ctx,
            n_tokens,
            self.costs,
            lambda: self.claim(ctx.owner),
            recompute_only=how is Restore.RECOMPUTE,
            read_only=how is Restore.READ,
            place=None if self.pool.arena is None else lambda payload, w: self._place(payload, w, ctx.owner),
        )
        self.counts.read += report.chunks_read
        self.counts.recomputed += report.chunks_recomputed
        self.counts.bad_files += len(report.bad_files)
        return report

    def swap_out(self, ctx: Context) -> int:
        """Every chunk of ctx to flash (written unless current, or dropped under Evict.DROP); returns
        the slots freed."""
        chunks = [(ctx, i) for i in ctx.chunks_in_memory()]
        if self.lifecycle.evict is not Evict.DROP:
            self.write(chunks)
        return self._free(chunks)

    def swap_out_idle(self, max_chunks: int) -> int:
        if not self.lifecycle.ahead or self.lifecycle.evict is Evict.DROP:
            return 0
        return self.write(self._unwritten(max_chunks))

    def flush(self) -> None:
        while self.write(self._unwritten(64)):
            pass

    def _unwritten(self, n: int) -> list:
        return [(c, i) for c, i in eviction_order(self.contexts.values()) if c.disk[i] is None][:n]

    def close(self) -> None:
        self.reader.close()
