"""FFN bundle reads through the reader pool: a layer's bundle region lands in a reused, page-aligned
buffer (so direct I/O reads straight into it). I/O only: numpy views, no framework arrays."""

from __future__ import annotations

import mmap

import numpy as np

from .manifest import FFNLayout
from .reader_pool import ReaderPool


class FFNReader:
    def __init__(self, pool: ReaderPool, path: str, layout: FFNLayout):
        self.pool = pool
        self.layout = layout
        self.file = pool.open(path)
        self._mem = mmap.mmap(-1, max(layout.layer_nbytes, 1))
        self.buf = np.frombuffer(self._mem, dtype=np.uint8)[: layout.layer_nbytes]
        self.bytes_read = 0  # bytes fetched from the device
        self.reads = 0  # read requests issued (after coalescing and splitting)
        self.wait_seconds = 0.0  # time the caller was blocked waiting for reads

    def read_layer(self, layer: int) -> np.ndarray:
        """All bundles of `layer` as a [n_rows, bundle_bytes] uint8 view of the reused buffer."""
        off = self.layout.layer_offsets[layer]
        batch = self.pool.read([(self.file, off, self.layout.layer_nbytes, self.buf)])
        self.bytes_read += batch.bytes_read
        self.reads += batch.reads
        self.wait_seconds += batch.wait_seconds
        return self.buf.reshape(self.layout.n_rows, self.layout.bundle_bytes)
