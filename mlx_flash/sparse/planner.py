"""The memory budget planner: one user number (`--memory-budget 50%` of the model's bytes, or bytes
such as `300MB`) decides what stays resident and how many FFN rows each layer may cache.

Accounting (store bytes, i.e. the weights as stored): the resident tensors (embeddings, attention,
norms), the predictors, one whole-layer transient buffer (prompt chunks and the naive/hybrid reads),
then the FFN rows: hybrid keeps a prefix of every layer resident, the predictor modes cache rows.
A budget that cannot hold the fixed part plus one row per layer is refused, naming the minimum.
"""

from __future__ import annotations

import re

from ..errors import ConfigError
from .sparse_ffn import NEEDS_PREDICTOR, SparsePlan

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def model_bytes(store) -> int:
    return sum(t.nbytes for t in store.manifest.tensors.values()) + store.manifest.ffn.layer_nbytes * len(
        store.manifest.ffn.layer_offsets)


def parse_budget(value, total: int) -> int:
    """'50%' -> half of total; 300000000, '300MB', '1.5GiB' -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[kKmMgG]?i?[bB]?)\s*", str(value))
        if not m:
            raise ConfigError(f"memory budget {value!r} is not understood (use e.g. 50%, 300MB or 1.5GiB)")
        num, unit = float(m.group(1)), m.group(2)
        n = int(total * num / 100) if unit == "%" else int(num * _UNITS[unit.lower()])
    if n <= 0:
        raise ConfigError(f"memory budget {value!r} must be positive")
    return n


def fmt(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def plan_budget(mode: str, budget: int, store, predictor_bytes: int, window: int,
                row_bytes: int | None = None) -> tuple[SparsePlan, dict]:
    """row_bytes: bytes of one cached row (default a whole bundle; less when only down columns are read)."""
    lay = store.manifest.ffn
    L, F, bb = len(lay.layer_offsets), lay.n_neurons, row_bytes or lay.bundle_bytes
    resident = sum(t.nbytes for t in store.manifest.tensors.values())
    preds = predictor_bytes if mode in NEEDS_PREDICTOR else 0
    fixed = resident + preds + lay.layer_nbytes
    minimum = fixed + (L * bb if mode != "naive" else 0)
    if budget < minimum:
        raise ConfigError(f"memory budget {fmt(budget)} is below the minimum {fmt(minimum)} for mode {mode!r} "
                          f"(resident weights {fmt(resident)}, predictors {fmt(preds)}, one-layer buffer "
                          f"{fmt(lay.layer_nbytes)}" + (", one FFN row per layer)" if mode != "naive" else ")"))
    rows = min(F, (budget - fixed) // (L * bb)) if mode != "naive" else 0
    plan = SparsePlan(mode=mode, capacity=rows, window=window, resident_neurons=rows if mode == "hybrid" else 0)
    account = {"budget": budget, "model_bytes": model_bytes(store), "resident_weights": resident,
               "predictors": preds, "layer_buffer": lay.layer_nbytes, "ffn_rows_per_layer": rows,
               "ffn_rows_bytes": rows * L * bb, "planned_total": fixed + rows * L * bb}
    return plan, account
