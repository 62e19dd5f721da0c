"""What the sparse FFN reads per token: the rows of the paper's Table 2, chosen once at load.

  naive      read the whole FFN layer every token
  hybrid     `resident_rows` rows of every layer kept in memory, the rest read every token (exact)
  predictor  read the predicted-active rows every token (no reuse), unbundled layout
  window     + keep the last k tokens' active rows cached and read only the difference, unbundled
  all        + bundled reads (gate row | up row | down column in one read)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


# Up to this many tokens at once (a decode step, or a speculative draft being verified) go through
# the neuron caches with the union of their active rows; longer prompt chunks read whole layers.
SMALL_BATCH = 16


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


@dataclass
class SparsePlan:
    """What the planner decided for one store and budget (sparse.planner)."""

    mode: SparseMode
    capacity: int = 0  # neuron-cache rows (bundles) per layer (predictor modes)
    window: int = 1  # tokens whose active sets stay cached (window, all)
    resident_rows: int = 0  # hybrid: rows (bundles) per layer kept in memory
