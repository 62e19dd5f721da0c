"""A policy's weight placement for a dense model: the first `resident` layers' FFNs held in memory
as stored (their bundle bytes, no float copy), the others read whole from the bundle file when
their layer computes, each read once per layer and step by the zig-zag schedule. With `overlap`
the next streamed layer's read starts when a layer is handed out (two buffers); without it each
read starts when its layer is asked for (the ablation)."""

from __future__ import annotations

import time

from ..ffn_source import FFNStats, LayerSource
from ..store.ffn_reader import FFNReader
from ..weights import bundle_weights


class PlacedFFN(LayerSource):
    same_for_every_input = True

    def __init__(self, ops, store, pool, resident: int, overlap: bool = True):
        self.ops, self.pool = ops, pool
        self.layout = lay = store.manifest.ffn
        n = len(lay.layer_offsets)
        streamed = list(range(resident, n))
        self.reader = FFNReader(pool, store.file_path(lay.file), lay, prefetch=overlap and bool(streamed),
                                order=streamed or None)
        # each resident layer in a buffer of its own: its weights are views of those bytes
        self.held = {i: bundle_weights(ops, lay, self.reader.read_layer(i).copy()) for i in range(resident)}
        self.reader.bytes_read = self.reader.reads = 0  # count what decoding reads, not the load
        self.reader.wait_seconds = 0.0
        self.mem_seconds = 0.0

    @property
    def resident_bytes(self) -> int:
        return len(self.held) * self.layout.layer_nbytes

    def layer(self, i: int, x=None):
        w = self.held.get(i)
        if w is not None:
            return w
        rows = self.reader.read_layer(i)
        t = time.perf_counter()
        w = bundle_weights(self.ops, self.layout, rows)
        self.mem_seconds += time.perf_counter() - t
        return w

    def stats(self) -> FFNStats:
        r = self.reader
        return FFNStats(io_seconds=r.wait_seconds, mem_seconds=self.mem_seconds, bytes_read=r.bytes_read, reads=r.reads)

    def close(self) -> None:
        self.reader.close()
        self.held = {}
