"""Activation sparsity by whole groups of input channels: a measured alternative to TEAL's single
channels, for reads a drive serves well. A group of `group` adjacent inputs of a product is zeroed
whole when its root-mean-square is at or below the (layer, input) threshold, so on flash a zeroed
group's codes and scales (the stored layout's group block: tens to hundreds of KB) are skipped
together. group=1 is TEAL with every input at the same level, the baseline its cost is stated against.

Offline only, for the sparse-reads benchmark: the dense engine's ops are wrapped, as the threshold
calibration wraps them (calibrate/thresholds.InputWatcher); nothing here runs per token in the engine,
and no option offers it (its quality cost is what the benchmark reports)."""

from __future__ import annotations

import numpy as np

from ..calibrate.perplexity_eval import perplexity
from ..calibrate.thresholds import InputWatcher, thresholded_weights, watching


class GroupOps(InputWatcher):
    """Sees each thresholded input by groups: recording their RMS (thresholds None) or zeroing the
    groups at or below their threshold, as it goes (each later input is what the zeroing made of it)."""

    def __init__(self, ops, where: dict[int, tuple[int, str]], group: int, thresholds: dict | None = None):
        super().__init__(ops, where)
        self.group, self.thresholds = group, thresholds
        self.rms: dict[tuple[int, str], list[np.ndarray]] = {}

    def seen(self, x, w, found):
        a = self._ops.to_numpy(x).astype(np.float32)
        n = a.shape[-1]
        rms = np.sqrt(np.mean(a.reshape(-1, n // self.group, self.group) ** 2, axis=2))
        if self.thresholds is None:
            self.rms.setdefault(found, []).append(rms)
            return x
        keep = np.repeat(rms > self.thresholds[found], self.group, axis=1)
        return x * self._ops.array(keep.reshape(a.shape).astype(np.float32))


def group_rms(engine, ids: list[int], group: int, context: int = 512) -> dict:
    """(layer, role) -> float32 [rows, groups]: each input's group RMS over `ids` in the dense engine
    (nothing zeroed), fed in windows of `context`; gate and up's shared input counted once."""
    where = thresholded_weights(engine)
    first = {}
    for wid, key in where.items():
        first.setdefault(key, wid)
    watcher = GroupOps(engine.ops, {wid: key for key, wid in first.items()}, group)
    with watching(engine, watcher):
        for s in range(0, len(ids), context):
            caches = engine.new_caches()
            engine.forward(ids[s : s + context], caches)
            engine.release(caches)
    return {k: np.concatenate(v) for k, v in watcher.rms.items()}


def group_thresholds(engine, ids: list[int], group: int, level: float, context: int = 512) -> dict:
    """(layer, role) -> the RMS below which `level` of that input's groups fall on `ids` (a dense,
    resident engine fed windows of `context`): every input at the same level."""
    return {k: float(np.quantile(v, level)) for k, v in group_rms(engine, ids, group, context).items()}


def open_loop_masks(rms: dict, group: int, level: float) -> dict:
    """(layer, role) -> bool [rows, n_in]: the channels whose group's RMS in the dense model (rms, as
    group_rms gives it) is above that input's `level` quantile: exactly `level` of each input's groups
    zeroed, each layer's input as dense computes it (GroupOps with thresholds zeroes as it goes, so
    later layers see what the zeroing made of their inputs)."""
    return {k: np.repeat(v > np.quantile(v, level), group, axis=1) for k, v in rms.items()}


def group_perplexity(engine, text: str, group: int, thresholds: dict, tokens: int = 4096, context: int = 512) -> float:
    """Perplexity over the first `tokens` of `text` (windows of `context`) with every row's inputs
    zeroed by groups at `thresholds`."""
    watcher = GroupOps(engine.ops, thresholded_weights(engine), group, thresholds)
    with watching(engine, watcher):
        return float(perplexity(engine, text, context=context, max_tokens=tokens)["perplexity"])
