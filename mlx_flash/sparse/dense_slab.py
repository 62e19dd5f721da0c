"""naive and hybrid (the paper's baselines): every token computes on layer i's whole slab of bundle
rows. naive reads the slab every token; hybrid keeps the first `resident_rows` rows of every
layer in memory and reads the rest. Both are exact: the slab is the layer, in neuron order."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..ffn_source import FFNStats, FFNWeights
from ..weights import bundle_weights, turned_layers
from .modes import SparseMode, SparsePlan
from .sparse_source import SparseSource


class DenseSlabFFN(SparseSource):
    def __init__(self, ops, store, pool, plan: SparsePlan):
        super().__init__(ops, store, pool, plan, prefetch=True, alloc=ops.host_buffer)
        lay = self.layout
        self.R = min(max(plan.resident_rows, 0), lay.n_rows) if plan.mode is SparseMode.HYBRID else 0
        self.resident = (
            [self.reader.read_layer(i)[: self.R].copy() for i in range(len(lay.layer_offsets))] if self.R else []
        )
        # a lazy backend: slabs read and resident rows copied in turn with the graph (weights.TurnedLayers)
        self.turned = turned_layers(ops, self.reader, "mlx-flash-slab-turns")

    def layer(self, i: int, x) -> FFNWeights:
        if self.turned is not None:
            self._count(x.shape[-2] == 1)
            return self.turned.layer(i, self.R, self._filler(i) if self.R else None)
        rows = self.read_slab(i, decode=x.shape[-2] == 1)
        t = time.perf_counter()
        w = bundle_weights(self.ops, self.layout, rows, i)
        self.extra.mem_seconds += time.perf_counter() - t
        return w

    def read_step(self, i: int, active: np.ndarray) -> None:
        self.read_slab(i, decode=True)

    def read_slab(self, i: int, decode: bool) -> np.ndarray:
        """Layer i's full slab of bundle rows. A decode step's rows read are counted like the
        predictor modes count theirs."""
        self._count(decode)
        rows = self.reader.read_layer(i, skip_rows=self.R)
        if not self.R:
            return rows
        R = self.R
        t = time.perf_counter()
        rows[:R] = self.resident[i]  # one slab in neuron order: the same matmul as the dense model
        self.extra.mem_seconds += time.perf_counter() - t
        return rows

    def _filler(self, i: int):
        """Writes layer i's resident rows into a slab read without them: one slab in neuron order, the
        same matmul as the dense model."""

        def fill(rows):
            rows[: self.R] = self.resident[i]

        return fill

    def _count(self, decode: bool) -> None:
        F, B = self.layout.n_rows, self.layout.block
        if decode:
            self.rows_loaded += (F - self.R) * B
            self.rows_active += F * B
            self.decode_layer_steps += 1

    def stats(self) -> FFNStats:
        st = super().stats()
        if self.turned is None:
            return st
        t = self.turned.turns
        return dataclasses.replace(
            st,
            io_seconds=st.io_seconds + t.wait_seconds,
            bytes_read=st.bytes_read + t.bytes_read,
            reads=st.reads + t.reads,
        )

    def close(self) -> None:
        if self.turned is not None:
            self.turned.close()
        super().close()

    def resident_bytes(self) -> int:
        return self.reader.nbytes + sum(r.nbytes for r in self.resident)
