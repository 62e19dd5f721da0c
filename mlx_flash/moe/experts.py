"""Expert sources for the MoE graph (ffn_source.ExpertSource): `waves(layer, routing [N, K])` yields
the experts the routing names, by ascending id, in waves held at once (the graph sums in that order,
so every source gives the same result bit for bit). Expert bytes lie in memory the backend's kernels
take in place (ops.host_buffer), a layer's in one buffer, so one grouped operation reads them all.

ResidentExperts  every expert read once at load into one buffer per layer, kept as backend weights
StreamedExperts  experts read from the bundle file when routed, kept in an ExpertCache of as many
                 slots as the memory budget allows, each with the expert's weights as converted for
                 compute (a hit converts nothing; moe.planner counts both). Where a format is multiplied
                 in place (weights.in_place), a slot's weights are views of the slot: built once, they
                 serve every expert of that format read there later, so a miss costs its read only.
                 A step that routes to more experts
                 than there are slots is served in waves of at most `slots` experts. With a RoutingPredictor,
                 a decode step preloads the next layer's most probable experts while this layer
                 computes; the router's real choice still decides what runs, so a wrong guess costs
                 only the bandwidth and the slot it took, and one still queued when the layer's demand
                 read comes is withdrawn (it never holds a reader the demand read could use).
"""

from __future__ import annotations

import time

import numpy as np

from ..ffn_source import ExpertSource, FFNStats, FFNWeights, routed_experts
from ..weights import bundle_weights, in_place
from .expert_cache import ExpertCache

PRELOAD_PRIORITY = 1  # the pool serves demand reads (priority 0) first


def expert_weights(ops, layout, layer: int, expert: int, buf: np.ndarray) -> FFNWeights:
    """One expert's bundle rows (at the start of `buf`, in its own format) -> backend weights."""
    sub = layout.expert_layout(layer, expert)
    n = layout.expert_rows * sub.bundle_bytes
    return bundle_weights(ops, sub, buf[:n].reshape(layout.expert_rows, sub.bundle_bytes), layer)


def read_expert(pool, file, layout, layer: int, expert: int, buf: np.ndarray):
    """Read one expert's bytes into `buf` (at least layout.expert_nbytes); returns the batch."""
    return pool.read([(file, layout.expert_offset(layer, expert), layout.expert_size(layer, expert), buf)])


class ResidentExperts(ExpertSource):
    def __init__(self, ops, store, pool):
        lay = store.manifest.ffn
        f = pool.open(store.file_path(lay.file))
        self.layers = []
        for i in range(len(lay.layer_offsets)):
            # one buffer per layer (weights that view their rows keep it alive): the grouped operation
            # reads every expert of the layer from it
            buf = ops.host_buffer(lay.n_experts * lay.expert_nbytes).reshape(lay.n_experts, lay.expert_nbytes)
            row = []
            for e in range(lay.n_experts):
                read_expert(pool, f, lay, i, e, buf[e])
                row.append(expert_weights(ops, lay, i, e, buf[e]))
            self.layers.append(row)

    def waves(self, layer: int, routing: np.ndarray):
        yield {e: self.layers[layer][e] for e in routed_experts(routing)}, False

    def every_expert(self, layer: int):
        return dict(enumerate(self.layers[layer]))

    def close(self) -> None:
        self.layers = []


class StreamedExperts(ExpertSource):
    """Counters as the dense FFN sources keep them (io_seconds: time blocked on reads, mem_seconds,
    bytes_read, reads), plus the preloader's: predicted / useful (preloaded experts the router then
    chose) / routed (experts decode steps asked for) / withdrawn (wrong guesses taken off the
    reader queue), preload_bytes, and preload_wait_seconds (the part of io_seconds spent waiting
    for preloads still in flight)."""

    def __init__(self, ops, store, pool, slots: int, policy: str = "edgemoe", predictor=None, preload: int = 0):
        self.ops, self.pool = ops, pool
        self.layout = lay = store.manifest.ffn
        self.n_layers = len(lay.layer_offsets)
        self.file = pool.open(store.file_path(lay.file))
        self.cache = ExpertCache(slots, lay.expert_nbytes, self.n_layers, policy, alloc=ops.host_buffer)
        self.predictor, self.preload = predictor, preload if predictor is not None else 0
        self.io_seconds = self.mem_seconds = self.preload_wait_seconds = 0.0
        self.bytes_read = self.reads = self.preload_bytes = 0
        self.predicted = self.useful = self.routed_count = self.withdrawn = 0
        self._path: list = [(), ()]  # the current token's choices at the last two layers
        self._inflight: list = []  # (layer, expert, batch) of preloads not yet waited for
        self._preloaded: set = set()  # keys in the cache because of a preload, not yet used
        self._copies: dict = {}  # slot -> ((layer, expert), converted weights) of the expert its bytes hold
        self._views: dict = {}  # (slot, key) -> in-place weights over the slot, for any expert of that key
        self._keys: dict = {}  # (layer, format) -> key of in-place weights (_key), or None (converted)

    def _follow(self, layer: int, routing: np.ndarray) -> None:
        """Remember a single token's choices at this layer and the one before (the routing
        predictor's condition); a prompt has no single path to follow."""
        if len(routing) != 1:
            self._path = [(), ()]
        else:
            self._path = [tuple(int(e) for e in routing[0]), self._path[0] if layer else ()]

    def waves(self, layer: int, routing: np.ndarray):
        # Not a generator itself: the path is followed when the graph asks, before any expert loads.
        self._follow(layer, routing)
        return self._load(layer, routed_experts(routing))

    def _load(self, layer: int, ids: list[int]):
        lay, cache = self.layout, self.cache
        self._settle(layer, ids)
        single = len(ids) <= cache.slots
        if self._path[0]:
            self.routed_count += len(ids)
            self.useful += sum((layer, e) in self._preloaded for e in ids)
        self._preloaded = {k for k in self._preloaded if k[0] != layer}  # used now, or a wrong guess
        for s in range(0, len(ids), cache.slots):
            wave = list(ids[s : s + cache.slots])
            pinned = {(layer, e) for e in wave}
            t = time.perf_counter()
            todo = cache.place(layer, wave, pinned=pinned | self._busy())
            self.mem_seconds += time.perf_counter() - t
            if todo:
                for _, slot in todo:
                    self._new_bytes(slot)
                self._account(
                    self.pool.read(
                        [
                            (self.file, lay.expert_offset(layer, e), lay.expert_size(layer, e), cache.buf[slot])
                            for e, slot in todo
                        ]
                    )
                )
            if single and self._path[0] and layer + 1 < self.n_layers and self.preload:
                self._start_preload(layer + 1, pinned)
            yield {e: self._converted(layer, e) for e in wave}, s + cache.slots < len(ids)

    def _key(self, layer: int, expert: int):
        """The experts whose in-place weights (views of a slot) serve this one: those of the same
        format and layer quantization; None when its format is converted for compute (a copy)."""
        lay = self.layout
        fmt = lay.expert_table[layer][expert][0] if lay.expert_table else 0
        if (layer, fmt) not in self._keys:
            sub = lay.expert_layout(layer, expert)
            quant = tuple(sorted((r, None if q is None else (q.bits, q.group_size, q.kind))
                                 for r, q in sub.quant_of(layer).items()))  # fmt: skip
            self._keys[(layer, fmt)] = (fmt, quant) if in_place(self.ops, sub) else None
        return self._keys[(layer, fmt)]

    def _new_bytes(self, slot: int) -> None:
        """Another expert's bytes land in `slot`: the old one's converted weights go (their memory
        freed); views of the slot stay, to serve whatever expert of their format it holds next."""
        self._copies.pop(slot, None)

    def _converted(self, layer: int, expert: int) -> FFNWeights:
        slot = self.cache.slot_of[(layer, expert)]
        key = self._key(layer, expert)
        if key is not None:
            held = self._views.get((slot, key))
        else:
            held = self._copies.get(slot)
            held = held[1] if held is not None and held[0] == (layer, expert) else None
        if held is None:
            t = time.perf_counter()
            held = expert_weights(self.ops, self.layout, layer, expert, self.cache.buf[slot])
            if key is not None:
                self._views[(slot, key)] = held
            else:
                self._copies[slot] = ((layer, expert), held)
            self.mem_seconds += time.perf_counter() - t
        return held

    def _start_preload(self, layer: int, pinned: set) -> None:
        """Read the predicted experts of `layer` into slots that this layer's experts do not hold,
        one batch per expert, so that a wrong guess can be withdrawn alone (_settle)."""
        guess = self.predictor.predict(
            layer, self._path[0], self._path[1], min(self.preload, self.cache.slots - len(pinned))
        )
        self.predicted += len(guess)
        todo = self.cache.prefetch(layer, guess, pinned | self._busy())
        lay = self.layout
        for e, slot in todo:
            self._new_bytes(slot)
            batch = self.pool.submit(
                [(self.file, lay.expert_offset(layer, e), lay.expert_size(layer, e), self.cache.buf[slot])],
                PRELOAD_PRIORITY,
            )
            self._inflight.append((layer, e, batch))
            self._preloaded.add((layer, e))

    def _settle(self, layer: int | None = None, ids=()) -> None:
        """Before a layer's demand read. A preload of an expert it routes to is waited for. A wrong
        guess is not: its reads still queued are withdrawn and its slot freed (once no worker
        writes there), and one whose reads all started runs on behind the demand read, its slot
        held until it lands (the `_busy` keys). With no layer (closing), every preload is waited for."""
        wanted = {(layer, e) for e in ids}
        running = []
        for at, e, batch in self._inflight:
            key = (at, e)
            if layer is not None and key not in wanted:
                if self.pool.withdraw(batch):
                    batch.wait()  # the reads a worker had started
                    self.cache.drop(*key)
                    self._preloaded.discard(key)
                    self.withdrawn += 1
                elif not batch.done():
                    running.append((at, e, batch))
                    continue
            batch.wait()
            self.preload_wait_seconds += batch.wait_seconds
            self.io_seconds += batch.wait_seconds
            self.preload_bytes += batch.bytes_read
            self.bytes_read += batch.bytes_read
            self.reads += batch.reads
        self._inflight = running
        if running and len(running) + len(ids) > self.cache.slots:  # the demand needs their slots
            self._settle()

    def _busy(self) -> set:
        """Keys whose slots a preload still writes: no one may evict them yet."""
        return {(at, e) for at, e, _ in self._inflight}

    def _account(self, batch) -> None:
        self.io_seconds += batch.wait_seconds
        self.bytes_read += batch.bytes_read
        self.reads += batch.reads

    def stats(self) -> FFNStats:
        return FFNStats(
            io_seconds=self.io_seconds,
            mem_seconds=self.mem_seconds,
            bytes_read=self.bytes_read,
            reads=self.reads,
            expert_policy=self.cache.policy.__class__.__name__,
            expert_slots=self.cache.slots,
            expert_hits=tuple(self.hit_stats()),
            preload=self.preload,
            preloaded_used=self.useful,
            preloads_withdrawn=self.withdrawn,
            routed_experts=self.routed_count,
        )

    def hit_stats(self) -> list[tuple[int, int]]:
        """Per layer (hits, misses) since load."""
        return list(zip(self.cache.hits, self.cache.misses))

    def close(self) -> None:
        self._settle()
        self.pool.close()
