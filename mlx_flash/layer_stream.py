"""Streamed layers: the resident tensors (attention, norms) of the layers the memory plan cannot hold
live in two slot buffers. Layer i's region of the resident file (one contiguous range: the converter
writes each layer's tensors together) is read into its slot before the layer computes, and the next
streamed layer's read is started meanwhile, so reading overlaps compute.

A streamed layer's backend weights are built once, at load, while its bytes are in its slot: the
large parts (packed codes, scales, biases) are views of the slot, so each re-read refreshes them in
place; small parts a backend copies (norm vectors) were copied from the layer's own bytes and stay
right (backends whose weights are not views of host memory cannot stream layers: `attach`).
Compute must have finished reading a slot before it is refilled. On an eager backend (torch) the
kernel runs when a linear is called, so a layer's products are done when the next layer starts. On a
lazy one (MLX) a token's forward is evaluated once: each time the graph reaches a streamed layer it
claims the layer's slot (slot_turns.py), and the read and the layer's products take turns inside the
graph, the slots in the backend's own memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from .errors import ConfigError
from .host_memory import anonymous_buffer
from .store.pool_file import ReadError
from .store.store import Store, lead, tensor_view


class LayerSlots:
    def __init__(self, store: Store, layers: list[int], pool, ops=None):
        """`ops`: the backend; a lazy one gets slots in its memory and turns (slot_turns.py)."""
        regions = store.layer_regions()
        if regions is None:
            raise ConfigError(
                f"{store.path}: its resident file does not keep each layer's tensors together "
                "(converted by an older version): convert the model again to stream layers"
            )
        self.store, self.pool, self.order = store, pool, list(layers)
        self.regions = {i: regions[i] for i in self.order}
        size = max(lead(off) + n for _, off, n in self.regions.values())
        n_slots = min(2, len(self.order))
        self.turns = ops.slot_turns("mlx-flash-layer-turns") if ops is not None and ops.lazy else None
        # the backend's memory (its kernels read it where it was read to), page-aligned for direct reads
        alloc = ops.host_buffer if ops is not None else anonymous_buffer
        self.slots = [alloc(max(size, 1)) for _ in range(n_slots)]
        self.slot_of = {layer: k % n_slots for k, layer in enumerate(self.order)}
        self.holds: list[int | None] = [None] * n_slots  # the layer each slot's bytes are
        self.pending: dict[int, tuple[int, object]] = {}  # slot -> (layer, batch) being read
        self.files = {f: pool.open(store.file_path(f)) for f, _, _ in self.regions.values()}
        self.bytes_read = self.reads = 0
        self.wait_seconds = 0.0
        self.read_ahead = True  # off: each layer read when reached (the throughput mode's no-overlap ablation)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def __contains__(self, layer) -> bool:
        return layer in self.slot_of

    def arrays(self, layer: int) -> dict[str, tuple[np.ndarray, str]]:
        """The layer's tensors as views of its slot (reading them first when the slot holds another)."""
        self.ensure(layer)
        file, off, n = self.regions[layer]
        slot = self.slots[self.slot_of[layer]]
        return {name: tensor_view(slot, off - lead(off), t) for name, t in self.store.layer_tensors(layer)}

    def ensure(self, layer: int) -> None:
        """Block until the layer's bytes are in its slot."""
        s = self.slot_of[layer]
        if self.holds[s] == layer:
            return
        if self.pending.get(s, (None,))[0] != layer:  # not read ahead: read it now
            self._drop_pending(s, wanted=False)
            self.pending[s] = (layer, self.pool.submit([self._range(layer)]))
        t = time.perf_counter()
        try:
            self._drop_pending(s)
        except ReadError:  # a read that failed (a read-ahead, maybe in an earlier call): read it now, once
            self.pending[s] = (layer, self.pool.submit([self._range(layer)]))
            self._drop_pending(s)
        self.wait_seconds += time.perf_counter() - t
        self.holds[s] = layer

    def claim(self, layer: int) -> None:
        """A lazy graph reaches `layer`: its slot's next turn reads it (unless the slot holds it), once
        the slot's previous layer is computed; the layer's products wait for the read in the graph."""
        s = self.slot_of[layer]
        self._drop_pending(s, wanted=False)  # a read started earlier: the turn below reads the slot again
        if self.holds[s] == layer:
            self.turns.claim(s, lambda: None)
            return
        self.holds[s] = layer
        rng = self._range(layer)
        self.turns.claim(s, lambda: self.pool.submit([rng]).wait())

    def prefetch_after(self, layer: int) -> None:
        """Start reading the streamed layer after `layer` (the first one after the last: the next
        token's) into its slot, unless that slot is the one `layer` computes from."""
        if not self.read_ahead:
            return
        nxt = self.order[(self.order.index(layer) + 1) % len(self.order)]
        s = self.slot_of[nxt]
        if s == self.slot_of[layer] or self.holds[s] == nxt or s in self.pending:
            return
        self.holds[s] = None  # being overwritten
        self.pending[s] = (nxt, self.pool.submit([self._range(nxt)]))

    def _range(self, layer: int):
        file, off, n = self.regions[layer]
        return (self.files[file], off, n, self.slots[self.slot_of[layer]][lead(off) : lead(off) + n])

    def _drop_pending(self, s: int, wanted: bool = True) -> None:
        """Wait for slot s's read in flight, if any, and count it. The failure of a read whose bytes
        are no longer `wanted` is not this caller's: the slot is read again before it is used."""
        if s in self.pending:
            _, batch = self.pending.pop(s)
            try:
                batch.wait()
            except ReadError:
                self.holds[s] = None
                if wanted:
                    raise
                return
            self._count(batch)

    def _count(self, batch) -> None:
        self.bytes_read += batch.bytes_read
        self.reads += batch.reads

    def attach(self, ops, layer_weights, layer: int) -> None:
        """The layer's weights, built while its bytes were in its slot: checked to be views of the slot
        (check_views), and on a lazy backend made to take the slot's turns."""
        self.check_views(ops, layer_weights, layer)
        if self.turns is not None:
            ops.gate_weights(layer_weights, self.turns.gate(self.slot_of[layer]))

    @property
    def blocked_seconds(self) -> float:
        """Time compute waited for streamed layers' reads (in Python, or inside the graph)."""
        return self.wait_seconds + (self.turns.wait_seconds if self.turns is not None else 0.0)

    @property
    def read_counts(self) -> tuple[int, int]:
        """(bytes read, reads) for streamed layers since load."""
        if self.turns is None:
            return self.bytes_read, self.reads
        return self.bytes_read + self.turns.bytes_read, self.reads + self.turns.reads

    def check_views(self, ops, layer_weights, layer: int) -> None:
        """Refuse a backend that copied the layer's large parts instead of viewing its slot: those
        copies would hold the layer in memory the plan gave to other things."""
        held, n = ops.held_bytes(layer_weights), self.regions[layer][2]
        copied = held - (n if held >= n else 0)  # views of the slot hold the layer's n bytes (or the slot)
        if copied > n // 4:
            raise ConfigError(
                f"the {ops.name} backend holds layer {layer}'s weights as copies ({copied} bytes beyond "
                "its read buffer), so layers cannot be streamed on it; give it memory for every layer"
            )

    def close(self) -> None:
        """Wait for reads in flight (they write into the slots), then close the reader pool."""
        for s in list(self.pending):
            self._drop_pending(s, wanted=False)
        if self.turns is not None:
            self.turns.close()
        self.pool.close()


class StreamedLayers(Sequence):
    """The model's per-layer weights, as the graph iterates them: a streamed layer's bytes are in its
    slot when the graph reaches it, the next streamed layer's read started."""

    def __init__(self, layers: list, slots: LayerSlots):
        self._layers, self.slots = layers, slots

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if i in self.slots:
            if self.slots.turns is not None:
                self.slots.claim(i)
            else:
                self.slots.ensure(i)
                self.slots.prefetch_after(i)
        return self._layers[i]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]
