"""The expert cache: a fixed number of preallocated slots, each holding one expert's bundle rows
(gate | up | down of all its neurons, as stored), shared by every MoE layer. Which expert a slot
holds is bookkeeping here; which to evict is the policy's call (moe.policies). I/O only: numpy
buffers, no framework arrays; the reads land straight in the slots."""

from __future__ import annotations

import numpy as np

from ..host_memory import anonymous_buffer
from .policies import make_policy


class ExpertCache:
    def __init__(self, slots: int, expert_nbytes: int, n_layers: int, policy: str = "edgemoe", alloc=None):
        """`alloc(nbytes)`: page-aligned uint8 memory for the slots (a backend's host_buffer, which its
        kernels take in place; anonymous memory by default)."""
        self.slots = slots
        alloc = alloc or anonymous_buffer
        self.buf = alloc(max(1, slots * expert_nbytes))[: slots * expert_nbytes].reshape(slots, expert_nbytes)
        self.policy = make_policy(policy, n_layers)
        self.slot_of: dict[tuple[int, int], int] = {}
        self.free = list(range(slots - 1, -1, -1))
        self.hits = [0] * n_layers
        self.misses = [0] * n_layers

    def has(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.slot_of

    def place(self, layer: int, experts: list[int], pinned: set) -> list[tuple[int, int]]:
        """Make room for the missing `experts` of `layer` (evicting none of `pinned`, the keys this
        step still needs) and return [(expert, slot)] the caller must fill; counts hits and misses."""
        todo = []
        for e in experts:
            key = (layer, e)
            if key in self.slot_of:
                self.hits[layer] += 1
                self.policy.touch(key, inserted=False)
                continue
            self.misses[layer] += 1
            slot = self._free_slot(layer, pinned)
            if slot is None:
                raise RuntimeError(f"expert cache: all {self.slots} slots are pinned by this step")
            self.slot_of[key] = slot
            self.policy.touch(key, inserted=True)
            todo.append((e, slot))
        return todo

    def prefetch(self, layer: int, experts: list[int], pinned: set) -> list[tuple[int, int]]:
        """Like `place` for experts not yet routed (a preload): no hit/miss is counted and the policy
        sees an arrival, not a use. Returns [(expert, slot)] to fill."""
        todo, keep = [], set(pinned)
        for e in experts:
            key = (layer, e)
            keep.add(key)
            if key in self.slot_of:
                continue
            slot = self._free_slot(layer, keep)
            if slot is None:
                break
            self.slot_of[key] = slot
            self.policy.admit(key)
            todo.append((e, slot))
        return todo

    def drop(self, layer: int, expert: int) -> None:
        """Forget an expert whose slot holds no whole copy of it (a preload withdrawn part-way)."""
        key = (layer, expert)
        self.policy.forget(key)
        self.free.append(self.slot_of.pop(key))

    def _free_slot(self, layer: int, pinned: set) -> int | None:
        if not self.free:
            candidates = [k for k in self.slot_of if k not in pinned]
            if not candidates:
                return None
            victim = self.policy.victim(candidates, layer)
            self.policy.forget(victim)
            self.free.append(self.slot_of.pop(victim))
        return self.free.pop()

    def rows(self, layer: int, expert: int) -> np.ndarray:
        return self.buf[self.slot_of[(layer, expert)]]
