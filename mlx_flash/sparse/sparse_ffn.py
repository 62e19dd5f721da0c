"""The FFN source of LLM in a flash (§3): per layer and token, only the rows the token needs come
from flash; attention, embeddings and predictors stay resident.

Modes (the rows of the paper's Table 2):
  naive      read the whole FFN layer every token
  hybrid     `resident_neurons` rows of every layer kept in memory, the rest read every token (exact)
  predictor  read the predicted-active rows every token (no reuse), unbundled layout
  window     + keep the last k tokens' active rows cached and read only the difference, unbundled
  all        + bundled reads (gate row | up row | down column in one read)

Decode steps (one token) use the per-layer neuron caches. Prompt chunks read the whole layer into
a transient buffer, compute with the predicted neurons only (a mask, so a prompt token sees exactly
what a decode step would), and seed the caches from that buffer. Neurons predicted inactive are
zeroed even when their rows are cached, so the predictor alone decides the output; the cache and
window only decide what is read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..ffn_source import FFNSource, FFNStats
from ..store.ffn_reader import FFNReader
from ..store.bundles import pack_layer, plan_fields, unpack_rows
from ..store.manifest import BundleField
from ..weights import bundle_weights, linear_parts
from .neuron_cache import NeuronCache
from .unbundled import ensure_unbundled, field_offsets
from .window import ActiveWindow

MODES = ("naive", "hybrid", "predictor", "window", "all")
# Up to this many tokens at once (a decode step, or a speculative draft being verified) go through
# the neuron caches with the union of their active rows; longer prompt chunks read whole layers.
SMALL_BATCH = 16
NEEDS_PREDICTOR = ("predictor", "window", "all")


@dataclass
class SparsePlan:
    mode: str
    capacity: int = 0  # neuron-cache rows per layer (predictor modes)
    window: int = 1  # tokens whose active sets stay cached (window, all)
    resident_neurons: int = 0  # hybrid: rows per layer kept in memory


# A selector's active(layer, x) takes the FFN input as the backend holds it ([..., D]) and returns
# which neurons each of its tokens needs, bool [tokens, F] on the host (the reads are planned there).


class AllActive:
    """A stand-in predictor that marks every neuron active (exactness checks)."""

    def __init__(self, n_neurons: int):
        self.n = n_neurons

    def active(self, layer: int, x) -> np.ndarray:
        return np.ones((int(np.prod(x.shape[:-1])), self.n), dtype=bool)


class LowRankSelector:
    def __init__(self, predictors, ops):
        self.p, self.ops = predictors, ops

    def active(self, layer: int, x) -> np.ndarray:
        xn = self.ops.to_numpy(x)
        return self.p.layers[layer].active(xn.reshape(-1, xn.shape[-1]))


def down_fields(layout) -> tuple[list[BundleField], list[int], int]:
    """The down-projection fields of a bundle packed into a row of their own, laid out like any
    bundle: (fields with their offsets in that row, their indices in layout.fields, row bytes)."""
    index = [k for k, f in enumerate(layout.fields) if f.name.startswith("down.")]
    fields, row_bytes = plan_fields([(layout.fields[k].name, np.empty((0, *layout.fields[k].shape)),
                                      layout.fields[k].dtype) for k in index])
    return fields, index, row_bytes


class SparseFFN(FFNSource):
    """down_only: gate|up come from the selector's resident 4-bit copy (`gate_up[i]`, all neurons)
    and only the down columns of active neurons are read and cached (a third of the bytes). Exact
    when the store's gate/up rows are 4-bit already; otherwise a named approximation."""

    def __init__(self, ops, store, pool, plan: SparsePlan, selector=None, progress: bool = False,
                 down_only: bool = False):
        if plan.mode not in MODES:
            raise ConfigError(f"sparse mode {plan.mode!r} is unknown (choose one of: {', '.join(MODES)})")
        if plan.mode in NEEDS_PREDICTOR and selector is None:
            raise ConfigError(f"sparse mode {plan.mode!r} needs a predictor")
        self.ops, self.pool, self.plan, self.selector = ops, pool, plan, selector
        self.layout = layout = store.manifest.ffn
        F, bb, L = layout.n_neurons, layout.bundle_bytes, len(layout.layer_offsets)
        self.down_only = down_only
        if down_only:
            if plan.mode not in NEEDS_PREDICTOR or not hasattr(selector, "weights"):
                raise ConfigError("down-only reads need a predictor mode and the gate predictor (its resident "
                                  "gate/up copy computes the activations)")
            self.row_fields, self._down_index, bb = down_fields(layout)
        else:
            self.row_fields = layout.fields
        self.row_bytes = bb
        self.reader = FFNReader(pool, store.file_path(layout.file), layout)  # whole-layer reads (transient buffer)
        self.mem_seconds = 0.0
        self.rows_loaded = 0  # neuron rows read by decode steps
        self.rows_active = 0  # predicted-active (token, layer, neuron) triples of decode steps
        self.decode_layer_steps = 0
        self._io_extra = 0.0
        self._bytes_extra = 0
        self._reads_extra = 0
        if plan.mode == "hybrid":
            R = min(max(plan.resident_neurons, 0), F)
            self.resident = [self.reader.read_layer(i)[:R].copy() for i in range(L)]
            self._R = R
        if plan.mode in NEEDS_PREDICTOR:
            self.caches = [NeuronCache(max(1, min(plan.capacity, F)), self.row_bytes, F) for _ in range(L)]
            self.windows = [ActiveWindow(plan.window if plan.mode != "predictor" else 1, F) for _ in range(L)]
            self.file = self.reader.file
            if plan.mode != "all" or down_only:  # down-only reads the unbundled down matrix in every mode
                self.unbundled = pool.open(ensure_unbundled(store, progress))
                self.field_offsets, _ = field_offsets(layout)

    # ---- the FFN source interface ----------------------------------------------------------------
    def layer(self, i: int, x) -> dict:
        if self.plan.mode in ("naive", "hybrid"):
            return self._decode(self.dense_rows(i, decode=x.shape[-2] == 1))
        active = self.selector.active(i, x)
        if active.shape[0] > SMALL_BATCH:
            return self._prompt(i, active, x.shape)
        return self._step(i, active, x.shape)

    # ---- modes -------------------------------------------------------------------------------------
    def dense_rows(self, i: int, decode: bool) -> np.ndarray:
        """naive / hybrid: layer i's full slab of bundle rows. A decode step's rows read are counted
        like the predictor modes count theirs."""
        F = self.layout.n_neurons
        if decode:
            self.rows_loaded += F - (self._R if self.plan.mode == "hybrid" else 0)
            self.rows_active += F
            self.decode_layer_steps += 1
        return self.reader.read_layer(i) if self.plan.mode == "naive" else self._hybrid_rows(i)

    def _hybrid_rows(self, i: int) -> np.ndarray:
        """Layer i's full slab: resident prefix copied in, the rest read."""
        R, rows = self._R, self.reader.buf.reshape(self.layout.n_neurons, self.layout.bundle_bytes)
        off = self.layout.layer_offsets[i] + R * self.layout.bundle_bytes
        n = (self.layout.n_neurons - R) * self.layout.bundle_bytes
        if n:
            batch = self.pool.read([(self.reader.file, off, n, self.reader.buf[R * self.layout.bundle_bytes:])])
            self._count(batch)
        t = time.perf_counter()
        rows[:R] = self.resident[i]  # one slab in neuron order: the same matmul as the dense model
        self.mem_seconds += time.perf_counter() - t
        return rows

    def _prompt(self, i: int, active: np.ndarray, shape) -> dict:
        rows = self.reader.read_layer(i)
        if self.down_only:  # keep the down fields only, in the caches' row layout
            t = time.perf_counter()
            down = unpack_rows([self.layout.fields[k] for k in self._down_index], rows)
            rows = pack_layer(self.row_fields, self.row_bytes, down)
            self.mem_seconds += time.perf_counter() - t
        fw = self._decode(rows, i)
        fw["mask"] = self.ops.array(active.reshape(*shape[:-1], -1).astype(np.float32))
        if self.plan.mode != "predictor":  # seed the window and cache from the rows in hand
            t = time.perf_counter()
            cache, win = self.caches[i], self.windows[i]
            for a in active[-win.k:]:
                win.push(np.flatnonzero(a), cache.capacity)
            keep = win.members()
            cache.delete(cache.live_ids()[~win.contains(cache.live_ids())])
            new = keep[~cache.has(keep)][: cache.capacity - cache.num_used]
            cache.rows[cache.append(new)] = rows[new]
            self.mem_seconds += time.perf_counter() - t
        return fw

    def _step(self, i: int, active: np.ndarray, shape) -> dict:
        """active [T, F] for T <= SMALL_BATCH tokens: read the rows of their union the cache lacks,
        compute on the cached slab, and mask each token to its own active neurons."""
        rows, keep, row_ids = self.fetch(i, active)
        fw = self._decode(rows, i, row_ids)
        if not keep.all():
            fw["mask"] = self.ops.array(keep.reshape(*shape[:-1], -1).astype(np.float32))
        return fw

    def fetch(self, i: int, active: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The I/O half of a step: update window and cache for active [T, F], read what is missing,
        and return (rows to compute on, keep mask [T, rows], their neuron ids)."""
        need = active.any(0)
        ids = np.flatnonzero(need)
        cache, win = self.caches[i], self.windows[i]
        t = time.perf_counter()
        if self.plan.mode == "predictor":
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
        self.mem_seconds += time.perf_counter() - t
        extra = np.empty((overflow.size, self.row_bytes), np.uint8)  # the reads fill every field of every row
        self._read_rows(i, to_cache, cache.rows, slots, overflow, extra)
        self.rows_loaded += to_cache.size + overflow.size
        self.rows_active += int(active.sum())
        self.decode_layer_steps += active.shape[0]
        t = time.perf_counter()
        rows, row_ids = cache.live_rows(), cache.live_ids()
        if overflow.size:
            rows, row_ids = np.concatenate([rows, extra]), np.concatenate([row_ids, overflow])
        if rows.shape[0] == 0:  # nothing active: one zero row, masked out, keeps the graph's shapes
            rows, row_ids = np.zeros((1, self.row_bytes), np.uint8), np.zeros(1, np.int64)
            keep = np.zeros((active.shape[0], 1), dtype=bool)
        else:
            keep = active[:, row_ids]
        self.mem_seconds += time.perf_counter() - t
        return rows, keep, row_ids

    # ---- reads ---------------------------------------------------------------------------------------
    def _read_rows(self, i, ids, dest, slots, overflow_ids, overflow_dest) -> None:
        """Rows of neurons `ids` into dest rows `slots` (and overflow rows into overflow_dest), as one
        batch: one range per neuron from the bundle file, or one per field from the unbundled one."""
        lay, bb = self.layout, self.row_bytes
        jobs = [(ids, dest, slots), (overflow_ids, overflow_dest, np.arange(overflow_ids.size))]
        batches = []
        for nid, d, s in jobs:
            if nid.size == 0:
                continue
            flat = d.reshape(-1)
            if self.plan.mode == "all" and not self.down_only:
                batches.append(self.pool.submit_rows(self.file, lay.layer_offsets[i] + nid * bb, bb, flat, s * bb,
                                                     row_bytes=bb))
            else:
                offs, lens, douts = [], [], []
                # One range per field (or per down field), from that field's own matrix.
                index = self._down_index if self.down_only else range(len(lay.fields))
                for f, k in zip(self.row_fields, index):
                    offs.append(self.field_offsets[i][k] + nid * f.nbytes)
                    lens.append(np.full(nid.size, f.nbytes))
                    douts.append(s * bb + f.offset)
                batches.append(self.pool.submit_rows(self.unbundled, np.concatenate(offs), np.concatenate(lens),
                                                     flat, np.concatenate(douts), row_bytes=bb))
        for b in batches:
            b.wait()
            self._count(b)

    def _count(self, batch) -> None:
        self._io_extra += batch.wait_seconds
        self._bytes_extra += batch.bytes_read
        self._reads_extra += batch.reads

    def _decode(self, rows: np.ndarray, layer: int = -1, row_ids=None) -> dict:
        t = time.perf_counter()
        if self.down_only:
            dtypes = {f.name: f.dtype for f in self.row_fields}
            arrays = {k: (v, dtypes[k]) for k, v in unpack_rows(self.row_fields, rows).items()}
            d, ddt = linear_parts(arrays, "down")
            fw = {"gate_up": self.selector.weights[layer],
                  "down": self.ops.weight(d, self.layout.quant.get("down"), transposed=True, dtypes=ddt)}
            at, hidden = self.selector.hidden
            if at == layer:  # the selector just computed this layer's activations from the same x
                fw["hidden"] = hidden
            if row_ids is not None:
                fw["rows"] = self.ops.array(np.asarray(row_ids, dtype=np.int64))
        else:
            fw = bundle_weights(self.ops, self.layout, rows)
        self.mem_seconds += time.perf_counter() - t
        return fw

    # ---- stats ------------------------------------------------------------------------------------------
    @property
    def io_seconds(self) -> float:
        return self.reader.wait_seconds + self._io_extra

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read + self._bytes_extra

    @property
    def reads(self) -> int:
        return self.reader.reads + self._reads_extra

    def stats(self) -> FFNStats:
        return FFNStats(io_seconds=self.io_seconds, mem_seconds=self.mem_seconds, bytes_read=self.bytes_read,
                        reads=self.reads,
                        sparse_mode=self.plan.mode, neurons=self.layout.n_neurons, rows_active=self.rows_active,
                        rows_loaded=self.rows_loaded, decode_layer_steps=self.decode_layer_steps,
                        cached_rows=tuple(self.cached_rows()), cache_capacity=self.plan.capacity)

    def cached_rows(self) -> list[int]:
        return [c.num_used for c in getattr(self, "caches", [])]

    def resident_bytes(self) -> int:
        """Weight bytes this source holds: caches, hybrid rows, the transient layer buffer."""
        n = self.layout.layer_nbytes  # the transient whole-layer buffer
        n += sum(c.nbytes for c in getattr(self, "caches", []))  # rows of row_bytes each
        n += sum(r.nbytes for r in getattr(self, "resident", []))
        return n

    def reset(self) -> None:
        """Forget cached rows and windows (a new, unrelated sequence)."""
        for c in getattr(self, "caches", []):
            c.clear()
        for w in getattr(self, "windows", []):
            w.clear()

    def close(self) -> None:
        self.pool.close()
