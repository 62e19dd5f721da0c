"""The sparse FFN's planner: the weights' share of the process's memory limit (what
memory/process_plan.py leaves after the runtime, KV cache and buffers, or `--weights-budget`: 50% of
the model's bytes, or bytes such as `300MB`) decides what stays resident and how many FFN rows each
layer may cache.

Accounting is in bytes as held in memory: the resident tensors (embeddings, attention, norms) and
the predictors as the compute backend keeps them (a float32 backend holds a 4-bit tensor at 8x its
stored size), one whole-layer read buffer and one layer's weights converted for compute (prompt
chunks and the naive/hybrid slabs), then the FFN rows as stored: hybrid keeps a prefix of every
layer, the predictor modes cache rows. "50%" is of the bytes the fully resident model holds on the
same backend (resident tensors plus every FFN layer converted for compute).
A budget that cannot hold the fixed part plus one row per layer is refused, naming the minimum.

Window size (window and all modes, `window=0`): the cost model predicts each window's per-token
I/O from the activity measured on validation text (rows a window of k reads per token), among the
windows whose cached union fits the rows the budget leaves; the cheapest wins (§3.2: the paper
shrinks the window to fit memory).
"""

from __future__ import annotations

from ..errors import MemoryBudgetError
from ..store.sizes import resident_bytes
from ..units import fmt
from . import cost_model
from .modes import SparseMode, SparsePlan

DEFAULT_WINDOW = 4  # when no activity was measured (predictors trained before it was recorded, or none)


def choose_window(
    activity: dict, capacity: int, n_rows: int, n_layers: int, row_bytes: int, profile: dict, threads: int
) -> tuple[int, list[dict]]:
    """(window, one row per window size tried: the rows it caches and reads per layer and its predicted
    I/O ms per token). Windows whose union overflows `capacity` rows are not eligible; window 1
    always is (its overflow is read every token whatever the window)."""
    table, best = [], (float("inf"), 1)
    for k, (u, new) in enumerate(zip(activity["union"], activity["new"]), start=1):
        cached, reads = u * n_rows, new * n_rows
        if k > 1 and cached > capacity:
            break
        if k == 1:  # a cache smaller than one token's set re-reads the part it cannot hold
            reads = max(reads, u * n_rows - capacity)
        ms = cost_model.io_seconds(profile, reads * row_bytes * n_layers, reads * n_layers, n_layers, threads) * 1e3
        table.append({"window": k, "cached_rows": round(cached), "rows_read": round(reads), "predicted_io_ms": ms})
        best = min(best, (ms, k))
    return best[1], table


def plan_budget(
    mode: SparseMode,
    budget: int,
    store,
    predictor_bytes: int,
    window: int,
    row_bytes: int | None = None,
    activity: dict | None = None,
    profile: dict | None = None,
    threads: int = 1,
    resident: int | None = None,
    converted_layer: int = 0,
) -> tuple[SparsePlan, dict]:
    """row_bytes: bytes of one cached row (default a whole bundle; less when only down columns are read).
    resident: bytes the backend holds for the resident tensors (default: as stored); converted_layer:
    bytes of one FFN layer converted for compute (0 when compute reads the rows as they are).
    window 0: chosen by `choose_window` from `activity` and the disk `profile` (DEFAULT_WINDOW without them)."""
    lay = store.manifest.ffn
    L, F, bb = len(lay.layer_offsets), lay.n_rows, row_bytes or lay.bundle_bytes
    resident = resident_bytes(store) if resident is None else resident
    preds = predictor_bytes if mode.needs_predictor else 0
    buffers = 2 * lay.layer_nbytes if not mode.needs_predictor else lay.layer_nbytes  # naive/hybrid prefetch
    fixed = resident + preds + buffers + converted_layer
    caches = mode is not SparseMode.NAIVE  # naive holds no rows beyond the layer buffer
    minimum = fixed + (L * bb if caches else 0)
    if budget < minimum:
        raise MemoryBudgetError(
            f"weights budget {fmt(budget)} (what the memory budget leaves for weights, or "
            f"--weights-budget) is below the minimum {fmt(minimum)} for mode "
            f"{mode.value!r} (resident weights {fmt(resident)}, predictors {fmt(preds)}, layer "
            f"buffers {fmt(buffers)}, one converted layer {fmt(converted_layer)}"
            + (", one FFN row per layer)" if caches else ")")
        )
    rows = min(F, (budget - fixed) // (L * bb)) if caches else 0
    table = []
    if window == 0:
        window = DEFAULT_WINDOW
        if mode.keeps_window and activity and profile:
            # activity is measured per neuron; for block bundles the share of bundles needed is at
            # least that (a bundle is needed when any of its neurons is), so this is a lower bound
            window, table = choose_window(activity, rows, F, L, bb, profile, threads)
    plan = SparsePlan(mode=mode, capacity=rows, window=window, resident_rows=rows if mode is SparseMode.HYBRID else 0)
    account = {
        "window": window,
        "window_costs": table,
        "budget": budget,
        "resident_weights": resident,
        "predictors": preds,
        "layer_buffer": buffers,
        "converted_layer": converted_layer,
        "ffn_rows_per_layer": rows,
        "ffn_rows_bytes": rows * L * bb,
        "planned_total": fixed + rows * L * bb,
    }
    return plan, account
