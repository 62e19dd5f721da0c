"""Selectors decide which FFN neurons each token needs; the sparse FFN reads and computes only those.

A selector's `select(layer, x)` takes the FFN input as the backend holds it ([..., D]) and returns a
`Selection`: which neurons each of its tokens needs, bool [tokens, F] on the host (the reads are
planned there), and the activations when the selector had to compute them to decide (the gate
predictor, sparse.gateup), so the FFN need not compute them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..choices import PredictorKind  # noqa: F401 (re-exported)
from ..errors import ConfigError


@dataclass
class Selection:
    active: np.ndarray  # bool [tokens, F]
    hidden: Any = None  # activations [..., F] as the backend holds them, when the selector computed them


class AllActive:
    """Marks every neuron active (exactness checks)."""

    def __init__(self, n_neurons: int):
        self.n = n_neurons

    def select(self, layer: int, x) -> Selection:
        return Selection(np.ones((int(np.prod(x.shape[:-1])), self.n), dtype=bool))


class LowRankSelector:
    """The trained low-rank predictors (sparse.predictor), run on the host."""

    def __init__(self, predictors, ops):
        self.p, self.ops = predictors, ops

    def select(self, layer: int, x) -> Selection:
        xn = self.ops.to_numpy(x)
        return Selection(self.p.layers[layer].active(xn.reshape(-1, xn.shape[-1])))


class StatisticalSelector:
    """Draws each token's active read units (bundles: one neuron, or a block of neurons) from a
    statistical activity model with `activity.active()` per layer; every neuron of a drawn unit is
    active. The FFN input is not looked at."""

    def __init__(self, activity, block: int):
        self.activity, self.block = activity, block

    def select(self, layer: int, x) -> Selection:
        units = np.concatenate([self.activity.active(layer) for _ in range(int(np.prod(x.shape[:-1])))])
        return Selection(np.repeat(units, self.block, axis=1))


class NoSelector:
    """For sources driven by a recorded activity instead of a model (I/O replay): computing raises."""

    def select(self, layer: int, x) -> Selection:
        raise ConfigError("this sparse FFN source was built for I/O replay and has no predictor to compute with")
