"""What every FFN source (resident, streamed, sparse, resident or streamed experts) offers the
engine, the chat and the public stats: a snapshot of its counters, a reset between unrelated
sequences, and close. Callers use these and never probe a source for attributes.

The model graphs ask a dense source for `layer(i, x)` (layer i's FFN weights for input x) and an
expert source for `routed(i, ids)` then `experts(i, ids)`; see models/llama.py and models/moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FFNStats:
    """Counters since load; every field is present for every source (zero or empty where the
    source has nothing to count)."""

    io_seconds: float = 0.0  # blocked waiting for reads
    mem_seconds: float = 0.0  # turning bytes read into backend weights, moving cached rows
    bytes_read: int = 0
    reads: int = 0
    # sparse FFN (LLM in a flash)
    sparse_mode: str = ""  # "" when the source is not sparse
    neurons: int = 0  # FFN neurons per layer
    rows_active: int = 0  # predicted-active (token, layer, neuron) triples of decode steps
    rows_loaded: int = 0  # neuron rows read by decode steps
    decode_layer_steps: int = 0
    cached_rows: tuple = ()  # rows in each layer's neuron cache now
    cache_capacity: int = 0  # rows a layer's neuron cache can hold
    # experts (EdgeMoE)
    expert_policy: str = ""  # "" when experts are not streamed through a cache
    expert_slots: int = 0
    expert_hits: tuple = ()  # per layer (hits, misses)
    preload: int = 0  # experts preloaded per layer and decode step
    preloaded_used: int = 0  # preloaded experts the router then chose
    routed_experts: int = 0  # experts decode steps routed to


class FFNSource:
    """Base of the FFN sources: a source with nothing to count or forget inherits these."""

    def stats(self) -> FFNStats:
        return FFNStats()

    def reset(self) -> None:
        """Forget per-sequence state (neuron windows, cached rows): a new, unrelated sequence."""

    def close(self) -> None:
        """Release files and threads; the source is unusable afterwards."""


class WrappedSource(FFNSource):
    """A source wrapped to observe it (calibration recorders): counters, reset and close are the
    wrapped source's own."""

    def __init__(self, inner: FFNSource):
        self.inner = inner

    def stats(self) -> FFNStats:
        return self.inner.stats()

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()
