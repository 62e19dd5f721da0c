"""The FFN-source protocol: where a model graph gets its FFN weights from.

Attention, embeddings and norms are resident (built once by `models.X.build`); only the FFN can
come from elsewhere. A source is one of two kinds, chosen at load from the store's manifest:

  LayerSource   dense FFNs: `layer(i, x)` returns the weights to apply to FFN input x at layer i
  ExpertSource  mixture-of-experts: `experts(i, routing)` yields each expert the routing names,
                with its weights, in ascending expert order

and every source, of either kind, answers `stats()` (an `FFNStats`, every field always present),
`reset()` between unrelated sequences, and `close()`. The engine, the chat and the public stats call
only these; nothing probes a source for attributes.

Adding a source: subclass `LayerSource` (or `ExpertSource`), implement `layer` (or `experts`), and
override `stats`/`reset`/`close` when it counts, remembers or holds something. `weights.ResidentFFN`
is the shortest example; `weights.StreamedFFN` adds reads and counters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator

import numpy as np


class GateActivation(Enum):
    """What a gated FFN applies to its gate: h = act(x·gate) * (x·up). A family's graph names it; the
    backend's sparse FFN applies it to the kernel's products with the same op the resident graph uses."""

    SILU = "silu"  # SwiGLU (Llama, Mistral, Qwen)
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation (Gemma 3)

    def apply(self, ops, gate):
        """act(gate) with the backend's op: the one place both the graphs and the sparse FFN take it."""
        return ops.silu(gate) if self is GateActivation.SILU else ops.gelu(gate, approximate=True)


@dataclass
class FFNWeights:
    """One FFN's weights as the backend holds them (a layer's, or one expert's), plus what a sparse
    source adds. Gated FFNs (SwiGLU) have `gate_up` (gate and up rows fused, [2F, D]); ungated ones
    (OPT's ReLU) have `up` [F, D]. `down` maps F to D (its orientation: weights.neuron_arrays).

    mask    [.., F] 0/1 per token and neuron: neurons a token does not use are zeroed (None: all used)
    rows    neuron ids of down's rows when gate_up covers every neuron but down only some (None: same)
    hidden  the activations act(gate)·up already computed from this x by the selector (None: compute)
    sparse  a SparseCall: the whole FFN is the backend's sparse kernel over a slab (the fields above
            unused)
    """

    down: Any
    gate_up: Any = None
    up: Any = None
    mask: Any = None
    rows: Any = None
    hidden: Any = None
    sparse: Any = None


@dataclass
class SparseCall:
    """One decode step's FFN by a sparse kernel (mlx_flash.kernels.sparse_ffn): the active bundles
    are slots idx[:count] of `slab` (a neuron cache's rows, uint8 [slots, row_bytes]); `mask`
    [T, count*block] float32 zeroes the neurons of those bundles a token does not use (None: all)."""

    kernel: Any
    slab: np.ndarray
    idx: np.ndarray
    count: int
    mask: np.ndarray | None = None


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
    sparse_kernel: str = ""  # what computes decode steps' active rows: cpu, metal, cuda or reference
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
    preloads_withdrawn: int = 0  # wrong guesses taken off the reader queue before a demand read
    routed_experts: int = 0  # experts decode steps routed to


class ReadCounters:
    """The counters every reading source keeps, fed by the reader pool's batches."""

    def __init__(self):
        self.io_seconds = self.mem_seconds = 0.0
        self.bytes_read = self.reads = 0

    def add(self, batch) -> None:
        """Count a batch of the reader pool the caller has waited for."""
        self.io_seconds += batch.wait_seconds
        self.bytes_read += batch.bytes_read
        self.reads += batch.reads


class FFNSource(ABC):
    """What both kinds share: counters, forgetting, closing. A source with nothing to count or
    forget inherits these."""

    # True when a dense source's layer(i, x) is the same weights whatever x is (resident, or read
    # whole): a batch's micro-batches then share one call per layer (batching/schedule.py)
    same_for_every_input: bool = False

    def stats(self) -> FFNStats:
        return FFNStats()

    def reset(self) -> None:
        """Forget per-sequence state (neuron windows, cached rows): a new, unrelated sequence."""

    def close(self) -> None:
        """Release files and threads; the source is unusable afterwards."""


class LayerSource(FFNSource):
    @abstractmethod
    def layer(self, i: int, x) -> FFNWeights:
        """Layer i's FFN weights for FFN input x ([B, T, D] as the backend holds it): all of them,
        or only the rows x needs (with a mask saying which neuron each token uses)."""


class ExpertSource(FFNSource):
    @abstractmethod
    def waves(self, i: int, routing: np.ndarray) -> Iterator[tuple[dict[int, FFNWeights], bool]]:
        """Layer i's experts for `routing` (int [N, K]: the K experts each of N tokens routes to) in
        waves of experts held at once: (expert -> weights, whether another wave follows), every
        expert routing names once, ids ascending across waves (the graph sums in that order, so every
        source gives the same result bit for bit). A source loads a wave as the caller asks for it,
        and the next may refill the memory this one's weights lie in: the caller computes what it
        built over a wave before advancing when another follows (a resident source has one wave)."""

    def every_expert(self, i: int) -> dict[int, FFNWeights] | None:
        """Layer i's every expert when the source holds them all (the graph then needs no routing on
        the host: a grouped kernel takes the routing where it is computed), else None."""
        return None

    def experts(self, i: int, routing: np.ndarray) -> Iterator[tuple[int, FFNWeights]]:
        """(expert, weights) for each expert `routing` names, ascending, wave after wave."""
        for wave, _ in self.waves(i, routing):
            yield from sorted(wave.items())


def routed_experts(routing: np.ndarray) -> list[int]:
    """The experts `routing` names, ascending: the order `ExpertSource.experts` yields them in."""
    return [int(e) for e in np.unique(routing)]


class _Delegating:
    """Counters, reset and close of a wrapped source are the wrapped source's own."""

    def __init__(self, inner):
        self.inner = inner

    def stats(self) -> FFNStats:
        return self.inner.stats()

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()


class WrappedLayerSource(_Delegating, LayerSource):
    """A dense source wrapped to observe it (calibration recorders)."""

    def layer(self, i: int, x) -> FFNWeights:
        return self.inner.layer(i, x)


class WrappedExpertSource(_Delegating, ExpertSource):
    """An expert source wrapped to observe it (routing recorders)."""

    def waves(self, i: int, routing: np.ndarray):
        return self.inner.waves(i, routing)
