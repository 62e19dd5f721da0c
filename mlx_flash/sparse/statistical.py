"""A labelled statistical model of FFN activity, for synthetic checkpoints whose random weights have
no activity of their own: it drives the statistical predictor (sparse.selectors.StatisticalSelector)
and the I/O replays of calibrate.io_replay. Everything measured with it is synthetic: the reads are
real, which units fire is drawn."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError


class StatisticalActivity:
    """Labelled statistical model of FFN activity (synthetic): each layer's neurons get a skewed
    activation propensity (a few hot neurons, a long cold tail, like measured ReLU models); each
    token keeps a share `persist` of the previous token's active neurons and draws the rest by
    propensity, so that `active` of all neurons fire per token."""

    def __init__(self, n_layers: int, n_neurons: int, active: float = 0.03, persist: float = 0.5, seed: int = 0):
        if not 0 < active < 1:
            raise ConfigError(f"active fraction must be in (0, 1) (got {active})")
        self.rng = np.random.default_rng(seed)
        self.k = max(1, int(round(active * n_neurons)))
        self.persist = persist
        w = self.rng.pareto(1.5, size=(n_layers, n_neurons)) + 1e-3
        self.p = w / w.sum(1, keepdims=True)
        self.last = [np.zeros(0, np.int64) for _ in range(n_layers)]

    def active(self, layer: int, x=None) -> np.ndarray:
        F = self.p.shape[1]
        prev = self.last[layer]
        keep = prev[self.rng.random(prev.size) < self.persist]
        need = self.k - keep.size
        p = self.p[layer].copy()
        p[keep] = 0
        new = self.rng.choice(F, size=need, replace=False, p=p / p.sum())
        ids = np.sort(np.concatenate([keep, new]))
        self.last[layer] = ids
        out = np.zeros((1, F), dtype=bool)
        out[0, ids] = True
        return out
