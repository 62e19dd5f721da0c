"""The enumerated choices of the options, as typed values chosen once (options.py, config.py): the
sparse FFN's modes, kernels and predictors, the expert caches' policies and the stores' precisions.
A leaf: it imports nothing of the package, so the options and the packages that act on them
(sparse/, moe/, convert/) all import down to it. Each is re-exported where it is acted on."""

from __future__ import annotations

from enum import Enum

# The FFN precisions a store is converted to (convert.convert's `precision`).
PRECISIONS = ("source", "source-neuron", "f16", "q4", "q8")


class SparseKernel(Enum):
    AUTO = "auto"  # the backend's sparse FFN kernel (cpu, metal, cuda) where the store's layout allows
    REFERENCE = "reference"  # the active rows as framework weights, multiplied by the backend's linears


class SparseMode(Enum):
    NAIVE = "naive"
    HYBRID = "hybrid"
    PREDICTOR = "predictor"
    WINDOW = "window"
    ALL = "all"

    @property
    def needs_predictor(self) -> bool:
        """Reads only the rows a predictor selects (the other modes read whole layers)."""
        return self in (SparseMode.PREDICTOR, SparseMode.WINDOW, SparseMode.ALL)

    @property
    def keeps_window(self) -> bool:
        """Keeps the last k tokens' rows cached and reads only what they lack."""
        return self in (SparseMode.WINDOW, SparseMode.ALL)

    @property
    def bundled_reads(self) -> bool:
        """Reads a neuron's gate row, up row and down column as one range of the bundle file."""
        return self is SparseMode.ALL


class PredictorKind(Enum):
    LOWRANK = "lowrank"  # trained low-rank predictors saved in the store (tools/train_predictor.py)
    GATE = "gate"  # the FFN's own gate/up projection, resident in 4 bits (sparse.gateup)
    DENSE = "dense"  # every neuron: exact
    # a labelled statistical model of which read units fire (sparse.statistical.StatisticalActivity),
    # for synthetic checkpoints whose random weights have no activity to predict: the reads are
    # real, the output is noise
    STATISTICAL = "statistical"


class ExpertPolicy(Enum):
    """The policies an expert cache can run with (belady needs the future: simulation only)."""

    EDGEMOE = "edgemoe"
    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"


class SparsityRows(Enum):
    """Which rows of a product the activation-sparsity thresholds apply to (backends/thresholded.py)."""

    DECODE = "decode"  # one-row steps; prompts and several sequences at once run dense
    ALL = "all"  # every row: each token of a text scored as a decode step would compute it (quality figures)
