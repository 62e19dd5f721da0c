"""One layer's cache of FFN bundle rows, laid out as in LLM in a flash §3.3 (Fig. 6).

A preallocated matrix holds up to `capacity` bundle rows (gate row | up row | down column of one
neuron, as stored). `ids[r]` names the neuron in row r; rows [0, num_used) are live. Deleting rows
moves the last live rows into the freed slots, so the live rows stay one contiguous slab that the
FFN multiplies directly; new rows are appended at num_used. Nothing is reallocated after __init__.
numpy only: I/O fills `rows` in place, the compute side views `rows[:num_used]`.
"""

from __future__ import annotations

import numpy as np

from ..host_memory import anonymous_buffer


class NeuronCache:
    def __init__(self, capacity: int, row_bytes: int, n_neurons: int, alloc=None):
        """`alloc(nbytes)`: the rows' memory (a backend's, which its kernels read in place); default
        page-aligned anonymous memory."""
        if capacity < 1 or capacity > n_neurons:
            raise ValueError(f"neuron cache capacity must be in [1, {n_neurons}] (got {capacity})")
        self.capacity, self.row_bytes, self.n_neurons = capacity, row_bytes, n_neurons
        # Page-aligned, so reads of whole aligned rows can land straight in it.
        self.rows = (alloc or anonymous_buffer)(capacity * row_bytes).reshape(capacity, row_bytes)
        self.ids = np.full(capacity, -1, dtype=np.int64)  # row -> neuron id
        self.slot = np.full(n_neurons, -1, dtype=np.int64)  # neuron id -> row, -1 when absent
        self.num_used = 0
        self.moved_rows = 0  # rows copied by deletions (memory-management work, for stats)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.row_bytes

    def live_ids(self) -> np.ndarray:
        return self.ids[: self.num_used]

    def live_rows(self) -> np.ndarray:
        return self.rows[: self.num_used]

    def has(self, neuron_ids: np.ndarray) -> np.ndarray:
        return self.slot[neuron_ids] >= 0

    def can_append(self, n: int) -> bool:
        return self.num_used + n <= self.capacity

    def delete(self, neuron_ids: np.ndarray) -> None:
        """Drop these (cached) neurons: the last live rows move into the freed slots."""
        neuron_ids = np.asarray(neuron_ids, dtype=np.int64)
        if neuron_ids.size == 0:
            return
        freed = self.slot[neuron_ids]
        if (freed < 0).any():
            raise KeyError(f"neurons {neuron_ids[freed < 0][:5].tolist()} are not cached")
        n, m = self.num_used, freed.size
        tail = n - m  # the new num_used
        holes = np.sort(freed[freed < tail])  # freed slots inside the slab that remains
        stays = np.ones(m, dtype=bool)
        stays[freed[freed >= tail] - tail] = False
        movers = np.arange(tail, n)[stays]  # live rows past the new end: they fill the holes
        self.slot[neuron_ids] = -1
        if holes.size:
            self.rows[holes] = self.rows[movers]
            self.ids[holes] = self.ids[movers]
            self.slot[self.ids[holes]] = holes
            self.moved_rows += int(holes.size)
        self.ids[tail:n] = -1
        self.num_used = tail

    def append(self, neuron_ids: np.ndarray) -> np.ndarray:
        """Reserve rows for these (uncached) neurons; returns their row numbers, for the reader
        to fill."""
        neuron_ids = np.asarray(neuron_ids, dtype=np.int64)
        k = neuron_ids.size
        if not self.can_append(k):
            raise ValueError(f"neuron cache full: {self.num_used} + {k} rows > capacity {self.capacity}")
        if k and (self.slot[neuron_ids] >= 0).any():
            raise KeyError("some neurons are already cached")
        rows = np.arange(self.num_used, self.num_used + k)
        self.ids[rows] = neuron_ids
        self.slot[neuron_ids] = rows
        self.num_used += k
        return rows

    def clear(self) -> None:
        self.slot[self.ids[: self.num_used]] = -1
        self.ids[: self.num_used] = -1
        self.num_used = 0
