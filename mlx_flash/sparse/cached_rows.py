"""predictor, window and all: per layer and token, only the rows the selector picks come from flash.

Decode steps (up to SMALL_BATCH tokens) go through per-layer neuron caches: the window (last k
tokens' active sets) decides what stays, the cache lists what is missing, and only that is read.
Prompt chunks read the whole layer into a transient buffer, compute with the selected neurons only
(a mask, so a prompt token sees exactly what a decode step would), and seed the caches from that
buffer. Neurons selected inactive are zeroed even when their rows are cached, so the selector alone
decides the output; the cache and window only decide what is read.

Caches and windows hold bundles (see FFNLayout): one neuron each, or a block of neurons in a store
that keeps the source's down groups. A bundle is needed when any of its neurons is selected; the
mask over its neurons still zeroes the unselected ones.

With a sparse kernel (mlx_flash.kernels.sparse_ffn, chosen at load), a decode step computes on the
active bundles' cache slots where they lie: no rows are gathered, and cached rows no token of the
step uses are not computed. Without one (or when the active rows overflow the cache), the live
rows become framework weights and the mask zeroes what the step does not use.
"""

from __future__ import annotations

import time

import numpy as np

from ..ffn_source import FFNWeights, SparseCall
from .modes import SMALL_BATCH, SparseMode, SparsePlan
from .neuron_cache import NeuronCache
from .row_format import block_neurons
from .selectors import NoSelector, Selection
from .sparse_source import SparseSource
from .window import ActiveWindow


class CachedRowsFFN(SparseSource):
    """fmt: the row format (row_format.BundleRows or DownRows); rows: where rows are read from
    (row_format.BundleFile or FieldFile); selector: picks the neurons (None: I/O replay only)."""

    def __init__(self, ops, store, pool, plan: SparsePlan, fmt, rows, selector=None, kernel=None):
        super().__init__(ops, store, pool, plan)
        self.fmt, self.rows, self.selector = fmt, rows, selector or NoSelector()
        self.kernel = kernel  # a sparse FFN kernel over whole-bundle cache rows, or None
        R, L = self.layout.n_rows, len(self.layout.layer_offsets)
        # in the backend's memory: its kernels read the rows where they were read to (on a lazy backend each
        # layer's cache changes only at that layer of the next token, after the token's graph ran)
        self.alloc = ops.host_buffer if ops is not None else None  # no backend: I/O replay
        self.caches = [NeuronCache(max(1, min(plan.capacity, R)), fmt.row_bytes, R, self.alloc) for _ in range(L)]
        self.windows = [ActiveWindow(plan.window if plan.mode.keeps_window else 1, R) for _ in range(L)]

    def layer(self, i: int, x) -> FFNWeights:
        sel = self.selector.select(i, x)
        if sel.active.shape[0] > SMALL_BATCH:
            return self._prompt(i, sel, x.shape)
        ids, overflow, extra = self.load(i, sel.active)
        if self.kernel is not None and not overflow.size:
            return FFNWeights(down=None, sparse=self._kernel_call(i, sel.active, ids))
        rows, keep, row_ids = self._compose(i, sel.active, overflow, extra)
        fw = self._weights(i, rows, sel, row_ids)
        if not keep.all():
            fw.mask = self.ops.array(keep.reshape(*x.shape[:-1], -1).astype(np.float32))
        return fw

    def read_step(self, i: int, active: np.ndarray) -> None:
        self.load(i, active)

    def _weights(self, i: int, rows: np.ndarray, sel: Selection, row_ids=None) -> FFNWeights:
        t = time.perf_counter()
        fw = self.fmt.weights(i, rows, sel, row_ids)
        self.extra.mem_seconds += time.perf_counter() - t
        return fw

    def _prompt(self, i: int, sel: Selection, shape) -> FFNWeights:
        rows = self.reader.read_layer(i)
        t = time.perf_counter()
        rows = self.fmt.from_layer(rows)
        self.extra.mem_seconds += time.perf_counter() - t
        fw = self._weights(i, rows, sel)
        fw.mask = self.ops.array(sel.active.reshape(*shape[:-1], -1).astype(np.float32))
        if self.plan.mode.keeps_window:  # seed the window and cache from the rows in hand
            t = time.perf_counter()
            cache, win = self.caches[i], self.windows[i]
            for a in self.row_activity(sel.active)[-win.k :]:
                win.push(np.flatnonzero(a), cache.capacity)
            keep = win.members()
            cache.delete(cache.live_ids()[~win.contains(cache.live_ids())])
            new = keep[~cache.has(keep)][: cache.capacity - cache.num_used]
            cache.rows[cache.append(new)] = rows[new]
            self.extra.mem_seconds += time.perf_counter() - t
        return fw

    def row_activity(self, active: np.ndarray) -> np.ndarray:
        """Neuron activity [T, F] -> bundle activity [T, n_rows]: a bundle is needed when any of its
        neurons is."""
        B = self.layout.block
        return active if B == 1 else active.reshape(active.shape[0], -1, B).any(2)

    def _kernel_call(self, i: int, neurons: np.ndarray, ids: np.ndarray) -> SparseCall:
        """The step's FFN over the active bundles `ids`, all in layer i's cache."""
        t = time.perf_counter()
        cache = self.caches[i]
        keep = neurons[:, block_neurons(ids, self.layout.block)]
        mask = None if keep.all() else keep.astype(np.float32)
        call = SparseCall(self.kernel, cache.rows, cache.slot[ids].astype(np.int32), int(ids.size), mask)
        self.extra.mem_seconds += time.perf_counter() - t
        return call

    def load(self, i: int, neurons: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Update window and cache for neuron activity [T, F] and read the bundles that are missing:
        (the active bundle ids, those the cache could not hold, their rows [overflow, row_bytes])."""
        active = self.row_activity(neurons)
        need = active.any(0)
        ids = np.flatnonzero(need)
        cache, win = self.caches[i], self.windows[i]
        t = time.perf_counter()
        if self.plan.mode is SparseMode.PREDICTOR:  # no reuse: every step reads its own rows
            cache.clear()
            win.clear()
        for a in active:
            win.push(np.flatnonzero(a), cache.capacity)
        live = cache.live_ids()
        cache.delete(live[~win.contains(live) & ~need[live]])
        wanted = ids[~cache.has(ids)]  # these tokens' rows first, then the rest of the window
        others = win.members()
        others = others[~cache.has(others) & ~need[others]]
        room = cache.capacity - cache.num_used
        to_cache = np.concatenate([wanted[:room], others[: max(0, room - wanted.size)]])
        slots = cache.append(to_cache)
        overflow = wanted[room:]  # active rows the cache cannot hold this step
        self.extra.mem_seconds += time.perf_counter() - t
        # the reads fill every field of every row (in a lazy backend's memory: the graph reads them later)
        n = overflow.size * self.fmt.row_bytes
        extra = (self.alloc(n) if n and self.alloc else np.empty(n, np.uint8)).reshape(-1, self.fmt.row_bytes)
        self._read(i, [(to_cache, cache.rows, slots), (overflow, extra, np.arange(overflow.size))])
        self.rows_loaded += (to_cache.size + overflow.size) * self.layout.block
        self.rows_active += int(neurons.sum())
        self.decode_layer_steps += active.shape[0]
        return ids, overflow, extra

    def _compose(self, i: int, neurons: np.ndarray, overflow: np.ndarray, extra: np.ndarray):
        """(the live cache rows and the overflow rows, keep mask [T, their neurons], their bundle ids)."""
        cache = self.caches[i]
        t = time.perf_counter()
        rows, row_ids = cache.live_rows(), cache.live_ids()
        if overflow.size:
            rows, row_ids = np.concatenate([rows, extra]), np.concatenate([row_ids, overflow])
        if rows.shape[0] == 0:  # nothing active: one zero row, masked out, keeps the graph's shapes
            rows, row_ids = np.zeros((1, self.fmt.row_bytes), np.uint8), np.zeros(1, np.int64)
            keep = np.zeros((neurons.shape[0], self.layout.block), dtype=bool)
        else:
            keep = neurons[:, block_neurons(row_ids, self.layout.block)]
        self.extra.mem_seconds += time.perf_counter() - t
        return rows, keep, row_ids

    def _read(self, i: int, jobs: list) -> None:
        """(neuron ids, destination rows, row slots) jobs as one batch of reads, waited for together."""
        batches = [self.rows.submit(i, ids, dest.reshape(-1), slots) for ids, dest, slots in jobs if ids.size]
        for b in batches:
            self.extra.add(b.wait())

    def kernel_name(self) -> str:
        return self.kernel.name if self.kernel is not None else "reference"

    def cached_rows(self) -> list[int]:
        return [c.num_used * self.layout.block for c in self.caches]

    def resident_bytes(self) -> int:
        return self.layout.layer_nbytes + sum(c.nbytes for c in self.caches)

    def reset(self) -> None:
        """Forget cached rows and windows (a new, unrelated sequence)."""
        for c in self.caches:
            c.clear()
        for w in self.windows:
            w.clear()
