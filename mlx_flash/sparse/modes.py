"""What the sparse FFN reads per token: the rows of the paper's Table 2, chosen once at load.

naive      read the whole FFN layer every token
hybrid     `resident_rows` rows of every layer kept in memory, the rest read every token (exact)
predictor  read the predicted-active rows every token (no reuse), unbundled layout
window     + keep the last k tokens' active rows cached and read only the difference, unbundled
all        + bundled reads (gate row | up row | down column in one read)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..choices import SparseKernel, SparseMode  # noqa: F401 (re-exported)


# Up to this many tokens at once (a decode step, or a speculative draft being verified) go through
# the neuron caches with the union of their active rows; longer prompt chunks read whole layers.
SMALL_BATCH = 16


@dataclass
class SparsePlan:
    """What the planner decided for one store and budget (sparse.planner)."""

    mode: SparseMode
    capacity: int = 0  # neuron-cache rows (bundles) per layer (predictor modes)
    window: int = 1  # tokens whose active sets stay cached (window, all)
    resident_rows: int = 0  # hybrid: rows (bundles) per layer kept in memory
