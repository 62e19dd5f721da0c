"""Expert sources for the MoE graph: `experts(layer, ids)` yields (expert, weights) for the
routed experts of one layer, in the order asked (the graph sums in that order, so every source
gives the same result bit for bit).

ResidentExperts  every expert read once at load and kept as backend weights (the reference)
StreamedExperts  experts read from the bundle file when routed, kept in an ExpertCache of as many
                 slots as the memory budget allows; a step that routes to more experts than there
                 are slots is served in waves of at most `slots` experts
"""

from __future__ import annotations

import time

import numpy as np

from ..weights import bundle_weights
from ..store.ffn_reader import FFNReader
from .expert_cache import ExpertCache


def expert_weights(ops, layout, rows: np.ndarray) -> dict:
    """One expert's bundle rows [expert_neurons * bundle_bytes] (or [n, bundle_bytes]) -> weights."""
    return bundle_weights(ops, layout, rows.reshape(layout.expert_neurons, layout.bundle_bytes))


class ResidentExperts:
    def __init__(self, ops, store, pool):
        lay = store.manifest.ffn
        reader = FFNReader(pool, store.file_path(lay.file), lay)
        Fe = lay.expert_neurons
        self.layers = []
        for i in range(len(lay.layer_offsets)):
            rows = reader.read_layer(i)
            self.layers.append([expert_weights(ops, lay, rows[e * Fe:(e + 1) * Fe]) for e in range(lay.n_experts)])

    def experts(self, layer: int, ids: list[int]):
        for e in ids:
            yield e, self.layers[layer][e]

    def close(self) -> None:
        self.layers = []


class StreamedExperts:
    """Counters as the dense FFN sources keep them: io_seconds, mem_seconds, bytes_read, reads."""

    def __init__(self, ops, store, pool, slots: int, policy: str = "edgemoe"):
        self.ops, self.pool = ops, pool
        self.layout = lay = store.manifest.ffn
        self.file = pool.open(store.file_path(lay.file))
        self.cache = ExpertCache(slots, lay.expert_nbytes, len(lay.layer_offsets), policy)
        self.io_seconds = 0.0
        self.mem_seconds = 0.0
        self.bytes_read = 0
        self.reads = 0

    def experts(self, layer: int, ids: list[int]):
        lay, cache = self.layout, self.cache
        for s in range(0, len(ids), cache.slots):
            wave = list(ids[s:s + cache.slots])
            t = time.perf_counter()
            todo = cache.place(layer, wave, pinned={(layer, e) for e in wave})
            self.mem_seconds += time.perf_counter() - t
            if todo:
                batch = self.pool.read([(self.file, lay.expert_offset(layer, e), lay.expert_nbytes, cache.buf[slot])
                                        for e, slot in todo])
                self.io_seconds += batch.wait_seconds
                self.bytes_read += batch.bytes_read
                self.reads += batch.reads
            for e in wave:
                t = time.perf_counter()
                w = expert_weights(self.ops, lay, cache.rows(layer, e))
                self.mem_seconds += time.perf_counter() - t
                yield e, w

    def hit_stats(self) -> list[tuple[int, int]]:
        """Per layer (hits, misses) since load."""
        return list(zip(self.cache.hits, self.cache.misses))

    def close(self) -> None:
        self.pool.close()
