"""What the two sparse FFN sources share (LLM in a flash, §3): the plan, the whole-layer reader, and
the counters the chat's /stats and the benchmarks read.

  DenseSlabFFN   (naive, hybrid)             sparse.dense_slab: a whole layer per token
  CachedRowsFFN  (predictor, window, all)    sparse.cached_rows: only the selected rows, cached

Attention, embeddings and predictors stay resident; build them with sparse.build.sparse_source.
"""

from __future__ import annotations

import numpy as np

from ..ffn_source import FFNStats, LayerSource, ReadCounters
from ..store.ffn_reader import FFNReader
from .modes import SparsePlan


class SparseSource(LayerSource):
    def __init__(self, ops, store, pool, plan: SparsePlan, prefetch: bool = False, alloc=None):
        """alloc: the whole-layer buffers' memory (default: anonymous; see FFNReader)."""
        self.ops, self.pool, self.plan = ops, pool, plan
        self.layout = store.manifest.ffn
        # whole-layer reads (with `prefetch`, the next layer's read overlaps this one's compute)
        self.reader = FFNReader(pool, store.file_path(self.layout.file), self.layout, prefetch, alloc=alloc)
        self.extra = ReadCounters()  # reads other than whole layers, and the time spent moving rows
        self.rows_loaded = 0  # neuron rows read by decode steps (bundles read x neurons per bundle)
        self.rows_active = 0  # predicted-active (token, layer, neuron) triples of decode steps
        self.decode_layer_steps = 0

    def read_step(self, i: int, active: np.ndarray) -> None:
        """The I/O of one decode step at layer i for active [T, F], without compute (I/O replay)."""
        raise NotImplementedError

    def kernel_name(self) -> str:
        """What computes decode steps' selected rows ("" for sources that compute whole layers)."""
        return ""

    def cached_rows(self) -> list[int]:
        """Neuron rows in each layer's cache now (none without caches)."""
        return []

    def resident_bytes(self) -> int:
        """Weight bytes this source holds: the transient whole-layer buffers, caches, hybrid rows."""
        return self.reader.nbytes

    def stats(self) -> FFNStats:
        r, x = self.reader, self.extra
        return FFNStats(
            io_seconds=r.wait_seconds + x.io_seconds,
            mem_seconds=x.mem_seconds,
            bytes_read=r.bytes_read + x.bytes_read,
            reads=r.reads + x.reads,
            sparse_mode=self.plan.mode.value,
            sparse_kernel=self.kernel_name(),
            neurons=self.layout.n_neurons,
            rows_active=self.rows_active,
            rows_loaded=self.rows_loaded,
            decode_layer_steps=self.decode_layer_steps,
            cached_rows=tuple(self.cached_rows()),
            cache_capacity=self.plan.capacity * self.layout.block,
        )

    def close(self) -> None:
        self.reader.close()
        self.pool.close()
