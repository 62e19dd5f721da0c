"""Simple synchronous FFN bundle reader: one pread of a layer's whole bundle region into a reused
buffer. (The parallel direct-I/O reader pool replaces this for sparse reads.)"""

from __future__ import annotations

import os
import time

import numpy as np

from ..errors import StoreError
from .manifest import FFNLayout


class FFNReader:
    def __init__(self, path: str, layout: FFNLayout):
        self.path = path
        self.layout = layout
        self.fd = os.open(path, os.O_RDONLY)
        self.buf = np.empty((layout.n_neurons, layout.bundle_bytes), dtype=np.uint8)
        self.bytes_read = 0
        self.reads = 0
        self.io_seconds = 0.0

    def read_layer(self, layer: int) -> np.ndarray:
        """All bundles of `layer` as a [F, bundle_bytes] uint8 view of the reused buffer."""
        off, n = self.layout.layer_offsets[layer], self.layout.layer_nbytes
        t = time.perf_counter()
        got = os.preadv(self.fd, [memoryview(self.buf).cast("B")], off)
        self.io_seconds += time.perf_counter() - t
        if got != n:
            raise StoreError(f"{self.path}: short read of FFN layer {layer} ({got} of {n} bytes at offset {off})")
        self.bytes_read += n
        self.reads += 1
        return self.buf

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
