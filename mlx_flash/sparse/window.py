"""Sliding window over the active-neuron sets of the last k tokens (LLM in a flash §3.3).

The neurons to keep cached are the union of the last k tokens' active sets; per token only the
difference is loaded. A count per neuron (in how many window tokens it was active) makes the union
O(active) per token. When the union would outgrow the cache, the window shrinks by dropping its
oldest tokens (the paper's adaptive window under a memory budget).
"""

from __future__ import annotations

from collections import deque

import numpy as np


class ActiveWindow:
    def __init__(self, k: int, n_neurons: int):
        if k < 1:
            raise ValueError(f"window size must be >= 1 (got {k})")
        self.k = k
        self.count = np.zeros(n_neurons, dtype=np.int32)
        self.sets: deque[np.ndarray] = deque()
        self.union_size = 0

    def push(self, active: np.ndarray, capacity: int) -> None:
        """Add this token's active ids, then drop the oldest tokens while there are more than k or
        the union exceeds `capacity` (the newest token always stays)."""
        self.sets.append(active)
        self.union_size += int((self.count[active] == 0).sum())
        self.count[active] += 1
        while len(self.sets) > 1 and (len(self.sets) > self.k or self.union_size > capacity):
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        old = self.sets.popleft()
        self.count[old] -= 1
        self.union_size -= int((self.count[old] == 0).sum())

    def members(self) -> np.ndarray:
        return np.flatnonzero(self.count > 0)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.count[ids] > 0

    @property
    def tokens(self) -> int:
        return len(self.sets)

    def clear(self) -> None:
        self.count[:] = 0
        self.sets.clear()
        self.union_size = 0
