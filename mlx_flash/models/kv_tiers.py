"""KV tiers for one sequence: a conversation longer than the memory its KV may take. Each layer keeps
its most recent tokens resident (a window in host memory the backend allocated); older ones move to a
file on flash (store/kv_tier_file.py, which the plan's maker opens) as the window fills, a step of
tokens at a time, and each layer's attention reads them back into one of two read buffers shared by
every layer, the file's tokens first and the resident ones written after them, so attention sees the
same keys, in the same order and layout, as the all-resident cache (models/cache.KVCache): the tokens are bit-identical.

    resident window   per layer, keys and values of the last `window + chunk` tokens at most (one
                      forward's new tokens always fit beside the window)
    read buffers      two, each one layer's keys and values of the whole context: layer i's while
                      layer i+1's is read
    on flash          tokens [0, flushed) of every layer, written once, read once per token per layer

On a lazy backend (MLX) the graph of a whole token is built before it runs: each layer's read is a
claim on its buffer's turns (slot_turns.py), served by a feeder thread once the layer two before it
has computed, and the attention takes the buffer through a fence; so layer i+1's read overlaps layer
i's compute. On an eager one (torch) a reader thread reads layer i+1's tokens on flash while layer i
computes; what moved to flash since is read when the layer is reached. Either way a layer's reads,
one per head, run READ_THREADS at a time.

Tokens move out of a window only when written earlier (evaluated: each forward ends in host memory),
so the I/O reads host memory, never a framework array.

Compressed (`kv_flash_bits`, an approximation: CodedTieredKV), tokens move to flash as blocks of
affine codes (models/kv_coded_blocks.py), a layer's blocks are read into a read buffer of blocks as
they lie, and the cache attends itself (the protocol's `attention`): the codes where the read put
them, then the window's float tokens, in one kernel call (ops.sdpa_coded), so no float copy of the
context is made and each token reads about a seventh of the bytes at 4 bits.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from ..errors import DiskError
from .cache import LayerKV
from .kv_coded_blocks import BlockFormat

_F32 = 4
READ_THREADS = 8  # reads in flight for a layer's tokens on flash
EVICT_STEP = 64  # tokens moved to flash at once: fewer, larger writes, and a window that never drops below its size


class TierFile(Protocol):
    """Where a sequence's older tokens lie (store/kv_tier_file.KVTierFile): bytes only."""

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Tokens [start, start + T) of one layer: k, v float32 [kv_heads, T, head_dim]."""

    def read_into(self, layer: int, start: int, n: int, k_out: np.ndarray, v_out: np.ndarray, pool=None) -> int:
        """Tokens [start, n) of one layer into k_out[:, start:n], v_out[:, start:n] (float32 [kv_heads,
        cap, head_dim]); `pool`: an executor that runs the reads side by side. The bytes read."""


class BlockFile(Protocol):
    """Where a sequence's older tokens lie compressed (store/kv_tier_file.KVBlockFile): whole blocks of
    tokens, each BlockFormat.nbytes."""

    def write_blocks(self, layer: int, start: int, data: np.ndarray) -> None:
        """Blocks from token `start` of one layer: uint8 [blocks, nbytes]."""

    def read_blocks(self, layer: int, start: int, n: int, out: np.ndarray, pool=None) -> int:
        """Tokens [start, n) of one layer (whole blocks) into those blocks of `out`; the bytes read."""


@dataclass(frozen=True)
class TierPlan:
    """What the memory plan gives one sequence's KV tiers: `window` tokens resident per layer plus one
    forward's `chunk`, a `context` of tokens in all, of a model of `layers` layers with `kv_heads` heads
    of `head_dim`; `open_file()` makes a new sequence's file (the caller knows the store): a TierFile,
    or with `coded` (tokens on flash compressed, an approximation) a BlockFile of its blocks."""

    window: int
    chunk: int
    context: int
    layers: int
    kv_heads: int
    head_dim: int
    open_file: Callable[[], TierFile | BlockFile]
    coded: BlockFormat | None = None

    @property
    def resident(self) -> int:
        return self.window + self.chunk

    @property
    def blocks(self) -> int:
        """Compressed blocks of the whole context."""
        return -(-self.context // self.coded.tokens)


class TierReads:
    """The two read buffers every layer of every tiered sequence of an engine shares (planned once),
    and on a lazy backend their turns; on an eager one a reader thread reads the next layer ahead."""

    def __init__(self, ops, plan: TierPlan):
        self.coded = plan.coded
        if plan.coded is None:  # each slot: keys, values [1, Hkv, context, hd]
            shape = (1, plan.kv_heads, plan.context, plan.head_dim)
            self.buffers = [tuple(_host(ops, shape) for _ in range(2)) for _ in range(2)]
        else:  # each slot: the context's blocks, uint8 [blocks, nbytes]
            nbytes = plan.coded.nbytes
            self.buffers = [(ops.host_buffer(plan.blocks * nbytes).reshape(plan.blocks, nbytes),) for _ in range(2)]
        self.turns = ops.slot_turns("mlx-flash-kv-turns") if ops.lazy else None
        self.reader = None if ops.lazy else ThreadPoolExecutor(1, thread_name_prefix="mlx-flash-kv-ahead")
        # a layer's reads (one per head) side by side: 8 layers of the 7B shape, page cache dropped, read
        # at 0.53 GB/s one at a time, 1.90 with 8 in flight (1.79 with 4, 1.61 with 16)
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="mlx-flash-kv-read")
        self._ahead: tuple | None = None  # (file, layer, tokens, future): a read ahead into its slot
        self._count = threading.Lock()
        self.bytes_read = 0

    def _fill(self, file: TierFile, layer: int, start: int, n: int) -> None:
        """Tokens [start, n) of `layer` into its slot's buffers."""
        bufs = self.buffers[layer % 2]
        if self.coded is None:
            nbytes = file.read_into(layer, start, n, bufs[0][0], bufs[1][0], self.readers)
        else:
            nbytes = file.read_blocks(layer, start, n, bufs[0], self.readers)
        with self._count:  # (the reader thread and the caller's both count)
            self.bytes_read += nbytes

    def read(self, ops, file, layer: int, n: int, after, flushed: list[int]) -> tuple:
        """The slot's buffers as backend arrays (keys, values [1, Hkv, context, hd]; compressed: the
        blocks), their first n tokens layer `layer`'s tokens in `file` (read now, or on a lazy backend
        when the buffer's turn comes). On an eager backend the next layer's tokens on flash so far
        (`flushed`: each layer's count) are then read ahead into the other buffer, which the layer
        before this one was done with (not past the last layer with an odd count: the next token's
        first layer would take this layer's buffer)."""
        bufs = self.buffers[layer % 2]
        if self.turns is not None:
            self.turns.claim(layer % 2, lambda: self._fill(file, layer, 0, n))
            gate = self.turns.gate(layer % 2)
            return tuple(ops.host_array(b, after, gate) for b in bufs)
        done = self._wait_ahead(file, layer)
        if done < n:  # what the read ahead did not cover: tokens moved to flash since
            self._fill(file, layer, done, n)
        nxt = layer + 1 if layer + 1 < len(flushed) else 0
        if nxt % 2 != layer % 2 and flushed[nxt]:  # what it holds on flash now (its update may add more)
            ahead = flushed[nxt]
            self._ahead = (file, nxt, ahead, self.reader.submit(self._fill, file, nxt, 0, ahead))
        return tuple(ops.host_array(b) for b in bufs)

    def _wait_ahead(self, file: TierFile, layer: int) -> int:
        """Wait for the read ahead, if any (it writes into a buffer); the tokens it read of `layer`."""
        if self._ahead is None:
            return 0
        f, ahead_layer, n, future = self._ahead
        self._ahead = None
        try:
            future.result()
        except DiskError:  # its slot is read again now (or was another sequence's): not this read's failure
            return 0
        return n if (f is file and ahead_layer == layer) else 0

    def close(self) -> None:
        """The engine closes: the feeder or reader thread stops."""
        if self.turns is not None:
            self.turns.close()
        if self.reader is not None:
            self.reader.shutdown(wait=True)
        self.readers.shutdown(wait=True)


class SequenceTiers:
    """What one sequence's layers share: its file on flash and the engine's read buffers."""

    def __init__(self, plan: TierPlan, reads: TierReads):
        self.plan, self.reads, self.shape = plan, reads, (plan.kv_heads, plan.head_dim)
        self.file = plan.open_file()
        self.flushed = [0] * plan.layers  # each layer's tokens on flash: [0, flushed)


def _host(ops, shape) -> np.ndarray:
    n = int(np.prod(shape)) * _F32
    return ops.host_buffer(n).view(np.float32).reshape(shape)


class TieredKV(LayerKV):
    """One layer of a sequence whose older tokens are on flash (see the module docstring)."""

    holds = "the KV tiers are planned for (raise --context)"

    def __init__(self, ops, seq: SequenceTiers, layer: int):
        self.seq, self.layer = seq, layer
        self.capacity = seq.plan.context
        shape = (1, seq.shape[0], seq.plan.resident, seq.shape[1])
        self.k_host, self.v_host = _host(ops, shape), _host(ops, shape)
        self.keys, self.values = ops.host_array(self.k_host), ops.host_array(self.v_host)
        self.resident = 0  # tokens in the window: [flushed, flushed + resident)

    @property
    def flushed(self) -> int:
        """Tokens on flash: [0, flushed) (kept with the sequence: the read ahead asks the next layer's)."""
        return self.seq.flushed[self.layer]

    @flushed.setter
    def flushed(self, n: int) -> None:
        self.seq.flushed[self.layer] = n

    @property
    def offset(self) -> int:
        return self.flushed + self.resident

    def update(self, ops, k, v):
        T, room = k.shape[2], self.seq.plan.resident
        if k.shape[0] != 1:
            raise ValueError("KV tiers hold one sequence")
        if T > room:
            raise ValueError(f"{T} new tokens at once exceed the KV window of {room} (prefill in chunks)")
        if self.offset + T > self.capacity:
            raise ValueError(f"{self.offset + T} tokens exceed the {self.capacity} {self.holds}")
        over = self.resident + T - room
        if over > 0:  # the oldest resident tokens (written by earlier forwards) go to flash
            e = min(self.resident, -(-over // EVICT_STEP) * EVICT_STEP)
            r = self.resident
            self._flush(self.k_host[0, :, :e], self.v_host[0, :, :e])
            for host in (self.k_host, self.v_host):
                host[:, :, : r - e] = host[:, :, e:r].copy()
            self.flushed, self.resident = self.flushed + e, r - e
        self.keys = ops.write_tokens(self.keys, k, self.resident)
        self.values = ops.write_tokens(self.values, v, self.resident)
        self.resident += T
        return self._gather(ops, k)

    def _flush(self, k: np.ndarray, v: np.ndarray) -> None:
        """The window's oldest tokens, keys and values [Hkv, e, hd], to flash after the flushed ones."""
        self.seq.file.write(self.layer, self.flushed, k, v)

    def _gather(self, ops, k):
        """Every held key and value: the tokens on flash read into a read buffer, the window after them."""
        r, n = self.resident, self.flushed
        if n == 0:
            return self.keys[:, :, :r, :], self.values[:, :, :r, :]
        keys, values = self.seq.reads.read(ops, self.seq.file, self.layer, n, k, self.seq.flushed)
        keys = ops.write_tokens(keys, self.keys[:, :, :r, :], n)
        values = ops.write_tokens(values, self.values[:, :, :r, :], n)
        return keys[:, :, : n + r, :], values[:, :, : n + r, :]

    def trim(self, n: int) -> None:
        self._check_trim(n)
        if n <= self.resident:
            self.resident -= n
        else:  # into the flushed tokens: the file's later tokens are overwritten when written again
            self.flushed -= n - self.resident
            self.resident = 0

    def state(self, ops):
        if self.offset == 0:
            raise ValueError("an empty cache has no state")
        H, D = self.seq.shape
        n, r = self.flushed, self.resident
        keys = np.empty((1, H, n + r, D), np.float32)
        values = np.empty_like(keys)
        self.seq.file.read_into(self.layer, 0, n, keys[0], values[0])
        keys[:, :, n:], values[:, :, n:] = self.k_host[:, :, :r], self.v_host[:, :, :r]
        return keys, values


class CodedTieredKV(TieredKV):
    """TieredKV whose tokens on flash are compressed blocks (plan.coded, models/kv_coded_blocks.py):
    update returns the resident window only, and attention reads the blocks where the read put them,
    as codes, with the window's float tokens after them (ops.sdpa_coded); the flushed count stays a
    whole number of blocks (EVICT_STEP is a block)."""

    def __init__(self, ops, seq: SequenceTiers, layer: int):
        super().__init__(ops, seq, layer)
        self.format = seq.plan.coded
        self.codes = None  # the read buffer this forward's attention reads the blocks from

    def _flush(self, k: np.ndarray, v: np.ndarray) -> None:
        self.seq.file.write_blocks(self.layer, self.flushed, self.format.encode(k, v))

    def _gather(self, ops, k):
        r, n = self.resident, self.flushed
        self.codes = self.seq.reads.read(ops, self.seq.file, self.layer, n, k, self.seq.flushed)[0] if n else None
        return self.keys[:, :, :r, :], self.values[:, :, :r, :]

    def attention(self, ops, q, keys, values, scale: float, mask):
        if self.codes is None:
            return ops.sdpa(q, keys, values, scale, mask)
        if mask is not None and not isinstance(mask, str):
            raise ValueError("KV on flash compressed attends causally only (this model masks otherwise)")
        return ops.sdpa_coded(q, keys, values, scale, self.codes, self.format, self.flushed)

    def _decoded(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [start, n) on flash (whole blocks) as attention computes with them: float32 [Hkv, n - start, hd]."""
        T = self.format.tokens
        blocks = np.empty((n // T, self.format.nbytes), np.uint8)
        self.seq.file.read_blocks(self.layer, 0, n, blocks)
        return self.format.decode(blocks[start // T :])

    def trim(self, n: int) -> None:
        self._check_trim(n)
        if n <= self.resident:
            self.resident -= n
            return
        keep = self.flushed - (n - self.resident)  # tokens held after the trim
        T = self.format.tokens
        start = keep // T * T
        if keep > start:  # the kept part of the last block comes back to the window, as attention saw it
            k, v = self._decoded(start, start + T)
            self.k_host[0, :, : keep - start], self.v_host[0, :, : keep - start] = (
                k[:, : keep - start],
                v[:, : keep - start],
            )
        self.flushed, self.resident = start, keep - start

    def state(self, ops):
        if self.offset == 0:
            raise ValueError("an empty cache has no state")
        n, r = self.flushed, self.resident
        k, v = self._decoded(0, n) if n else (np.empty((self.seq.shape[0], 0, self.seq.shape[1]), np.float32),) * 2
        keys = np.concatenate([k, self.k_host[0, :, :r]], axis=1)[None]
        values = np.concatenate([v, self.v_host[0, :, :r]], axis=1)[None]
        return keys, values


def make_tiered_caches(ops, plan: TierPlan, reads: TierReads) -> list[TieredKV]:
    """Every layer's cache of one new sequence, sharing its file and the engine's reads."""
    seq = SequenceTiers(plan, reads)
    kind = TieredKV if plan.coded is None else CodedTieredKV
    return [kind(ops, seq, i) for i in range(plan.layers)]
