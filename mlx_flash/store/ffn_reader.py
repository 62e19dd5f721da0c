"""FFN bundle reads through the reader pool: a layer's bundle region lands in a reused, page-aligned
buffer (so direct I/O reads straight into it). I/O only: numpy views, no framework arrays.

With `prefetch`, two buffers alternate: when layer i is handed out, the read of the next layer
(i + 1, or layer 0 of the next token after the last; with `order`, the next layer of that list,
cyclically) starts into the other buffer, so reading it overlaps computing layer i. The caller must
be done with layer i's rows before asking for layer i + 2 (the buffer is refilled then); the CPU
kernel computes when a linear is called, so a layer's products are done when the next layer is asked for.
"""

from __future__ import annotations

import time

import numpy as np

from ..host_memory import anonymous_buffer
from .manifest import FFNLayout
from .reader_pool import ReaderPool, ReadError


class FFNReader:
    def __init__(
        self,
        pool: ReaderPool,
        path: str,
        layout: FFNLayout,
        prefetch: bool = False,
        order: list[int] | None = None,
        alloc=None,
    ):
        """`alloc(nbytes)`: the buffers' memory (a backend's, which its kernels read in place);
        default page-aligned anonymous memory."""
        self.pool = pool
        self.order = list(order) if order is not None else list(range(len(layout.layer_offsets)))
        self.layout = layout
        self.file = pool.open(path)
        self.bufs = [(alloc or anonymous_buffer)(layout.layer_nbytes) for _ in range(2 if prefetch else 1)]
        self.buf = self.bufs[0]
        self.prefetch = prefetch
        self._holds = [None] * len(self.bufs)  # (layer, rows skipped) each buffer holds or is being filled with
        self._pending: dict[int, object] = {}  # buffer -> batch in flight
        self._last = len(self.bufs) - 1  # the buffer handed out last (read_layer)
        self.bytes_read = 0  # bytes fetched from the device
        self.reads = 0  # read requests issued (after coalescing and splitting)
        self.wait_seconds = 0.0  # time the caller was blocked waiting for reads

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs)

    def read_layer(self, layer: int, skip_rows: int = 0) -> np.ndarray:
        """The bundles of `layer` as a [n_rows, bundle_bytes] uint8 view of a reused buffer; rows
        below `skip_rows` are not read (the caller fills them: hybrid's resident rows)."""
        key = (layer, skip_rows)
        b = next((k for k, h in enumerate(self._holds) if h == key), None)
        if b is None:
            b = (self._last + 1) % len(self.bufs)
            self._discard(b)
            self._finish(self._submit(b, key))
        else:
            try:
                self._finish(b)
            except ReadError:  # a prefetch that failed (maybe in an earlier call): read it now, once
                self._finish(self._submit(b, key))
        self._last = b
        if self.prefetch:
            at = self.order.index(layer) if layer in self.order else -1
            nxt = (self.order[(at + 1) % len(self.order)], skip_rows)
            other = 1 - b
            if self._holds[other] != nxt:
                self._discard(other)
                self._submit(other, nxt)
        return self.bufs[b].reshape(self.layout.n_rows, self.layout.bundle_bytes)

    @property
    def last_buffer(self) -> int:
        """The buffer read_layer handed out last (its rows are views of it)."""
        return self._last

    def read_into(self, layer: int, alloc) -> np.ndarray:
        """The bundles of `layer` read into a buffer of their own, `alloc(nbytes)` (a backend's memory
        its kernels read in place): [n_rows, bundle_bytes] uint8, kept by the caller."""
        dest = alloc(self.layout.layer_nbytes)
        if self.layout.layer_nbytes:
            batch = self.pool.submit([(self.file, self.layout.layer_offsets[layer], self.layout.layer_nbytes, dest)])
            t = time.perf_counter()
            batch.wait()
            self.wait_seconds += time.perf_counter() - t
            self.bytes_read += batch.bytes_read
            self.reads += batch.reads
        return dest.reshape(self.layout.n_rows, self.layout.bundle_bytes)

    def rows_of(self, b: int) -> np.ndarray:
        """Buffer b as [n_rows, bundle_bytes] rows."""
        return self.bufs[b].reshape(self.layout.n_rows, self.layout.bundle_bytes)

    def read_rows(self, layer: int, b: int, skip_rows: int = 0):
        """Read `layer`'s rows from `skip_rows` on into buffer b now, bypassing the prefetch bookkeeping
        (a caller that takes turns with the compute itself: weights.TurnedLayers): the waited-for
        batch, or None when nothing is left to read."""
        start = skip_rows * self.layout.bundle_bytes
        n = self.layout.layer_nbytes - start
        if n <= 0:
            return None
        return self.pool.submit([(self.file, self.layout.layer_offsets[layer] + start, n, self.bufs[b][start:])]).wait()

    def _submit(self, b: int, key) -> int:
        layer, skip = key
        start = skip * self.layout.bundle_bytes
        self._holds[b] = key
        n = self.layout.layer_nbytes - start
        if n > 0:
            self._pending[b] = self.pool.submit(
                [(self.file, self.layout.layer_offsets[layer] + start, n, self.bufs[b][start:])]
            )
        return b

    def _finish(self, b: int) -> None:
        """Wait for buffer b's read, if one is in flight."""
        batch = self._pending.pop(b, None)
        if batch is None:
            return
        t = time.perf_counter()
        try:
            batch.wait()
        except BaseException:
            self._holds[b] = None
            raise
        self.wait_seconds += time.perf_counter() - t
        self.bytes_read += batch.bytes_read
        self.reads += batch.reads

    def _discard(self, b: int) -> None:
        """Wait for buffer b's read in flight, whose bytes are no longer wanted: its failure is not
        this caller's (the buffer is read again before it is handed out)."""
        try:
            self._finish(b)
        except ReadError:
            pass

    def close(self) -> None:
        """Wait for reads in flight (they write into this reader's buffers)."""
        for b in list(self._pending):
            try:
                self._finish(b)
            except Exception:
                pass
