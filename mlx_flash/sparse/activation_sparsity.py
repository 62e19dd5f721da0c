"""Activation sparsity on a loaded model (TEAL): every product's input behind its threshold.

The thresholds (sparse/thresholds.py) give each layer's q|k|v, o, gate|up and down inputs a magnitude
for the level asked; each of those weights becomes the backend's `Thresholded` (backends/
thresholded.py), which skips the channels at or below it. The graph is unchanged: it multiplies by
whatever weight it is handed. Applied at load to a model whose attention is resident, with its FFN
resident or sparse (ffn="sparse", predictor "gate": the neurons above down's thresholds are the rows
read); streamed attention layers and other FFN sources are refused, naming what to use instead.
"""

from __future__ import annotations

import dataclasses

from ..choices import SparsityRows
from ..errors import ConfigError
from ..weights import ResidentFFN
from .cached_rows import CachedRowsFFN
from .gateup import GateUpSelector
from .thresholds import Thresholds, load_thresholds


def threshold_products(ops, weights: dict, ffn, thresholds: Thresholds, level: float, rows: SparsityRows) -> list:
    """Wrap the thresholded weights of `weights` (a graph's resident weights) and, when `ffn` is a
    ResidentFFN, its layers' in place; returns (layer, input, Thresholded) for each product. A sparse
    FFN source (ffn="sparse") selects its neurons by down's thresholds itself (sparse/build.py)."""
    resident = isinstance(ffn, ResidentFFN)
    if not resident and not (isinstance(ffn, CachedRowsFFN) and isinstance(ffn.selector, GateUpSelector)):
        raise ConfigError(
            "sparsity needs the FFN resident (ffn='resident', or a memory budget the model fits) or sparse "
            "(ffn='sparse' with predictor 'gate', which reads only the neurons above down's thresholds)"
        )
    at, every_row, out = thresholds.at(level), rows is SparsityRows.ALL, []

    def wrap(w, i: int, role: str):
        if isinstance(w, tuple):  # products of differing quantization: each part behind the same threshold
            return tuple(wrap(part, i, role) for part in w)
        out.append((i, role, ops.thresholded(w, float(at[role][i]), every_row)))
        return out[-1][2]

    for i, lw in enumerate(weights["layers"]):
        lw["qkv"], lw["o"] = wrap(lw["qkv"], i, "qkv"), wrap(lw["o"], i, "o")
        if not resident:
            continue
        fw = ffn.layers[i]
        if fw.gate_up is None:
            raise ConfigError("sparsity needs a gated FFN (SwiGLU or GeGLU); this model's FFN is ungated")
        ffn.layers[i] = dataclasses.replace(fw, gate_up=wrap(fw.gate_up, i, "gate_up"), down=wrap(fw.down, i, "down"))
    return out


def sparsity_products(ops, store, cfg, weights: dict, ffn, streamed_layers: int) -> list:
    """The products of a model loaded with cfg.sparsity > 0, behind their thresholds."""
    if streamed_layers:
        raise ConfigError(
            f"sparsity {cfg.sparsity:g}: {streamed_layers} attention layers are streamed, and sparsity needs the "
            "model resident (a larger memory budget, or sparsity 0)"
        )
    if store.manifest.ffn.n_experts:
        raise ConfigError(
            f"sparsity {cfg.sparsity:g}: activation thresholds are for dense models; this model's FFN is experts"
        )
    found = load_thresholds(store, len(weights["layers"]))
    return [p for *_, p in threshold_products(ops, weights, ffn, found, cfg.sparsity, cfg.sparsity_rows)]


def sparsity_line(cfg, products: list) -> str:
    """What the load line says of sparsity."""
    if not products:
        return "off (dense)"
    fast = sum(p.kernel is not None for p in products)
    rows = "every row" if cfg.sparsity_rows is SparsityRows.ALL else "decode steps"
    return (
        f"{cfg.sparsity:.0%} of each product's inputs zeroed in {rows} (thresholds per layer and input); "
        f"{fast} of {len(products)} products skip their zeroed channels' bytes on the channel-major kernel"
        + ("" if fast == len(products) else ", the rest mask their inputs and read every byte")
    )
