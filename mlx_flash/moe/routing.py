"""The next-layer expert predictor (EdgeMoE §6, "prediction + preload"), as decoding uses it.

A routing trace is what the router chose for each token at each MoE layer, routes [L, N, K].
From traces of calibration text, `RoutingPredictor` estimates P(expert e at layer l | a chosen at
l-1, b chosen at l-2); a token that chose sets S1 at l-1 and S2 at l-2 scores e by the mean of that
probability over the pairs (a, b) in S1 x S2. Pairs seen rarely fall back to P(e | a) and then to
P(e at l) (additive smoothing), so every layer, including 0 and 1, has a ranking. Recording traces
and fitting the counts are offline (calibrate/routes.py).

The predictor is saved with the store's model id (the checksum of its resident weights, which hold
the routers): loading it for another model is refused with the two ids named.
"""

from __future__ import annotations

import io
import os

import numpy as np

from ..durable import write_durably
from ..errors import ConfigError, ModelFileError
from ..store.atomic_dir import OutputError
from ..store.manifest import RESIDENT_FILE

PREDICTOR_FILE = "routing_predictor.npz"  # in the store directory


def model_id(store) -> str:
    """Routing depends on the routers, which live in the resident weights: their checksum names the model."""
    return store.manifest.files[RESIDENT_FILE]["sha256"]


class RoutingPredictor:
    """Routing-path counts (fitted offline by calibrate.routes.fit_routing_predictor) and the expert
    ranking decoding preloads from."""

    def __init__(
        self, pair: np.ndarray, single: np.ndarray, marginal: np.ndarray, k: int, model: str, smoothing: float = 1.0
    ):
        self.pair = pair  # [L, E(a at l-1), E(b at l-2), E] tokens with a, b before and e at l
        self.single = single  # [L, E(a at l-1), E] tokens with a before and e at l
        self.marginal = marginal  # [L, E] tokens with e at l
        self.k = k  # experts per token
        self.model = model
        self.smoothing = smoothing

    @property
    def n_layers(self) -> int:
        return self.marginal.shape[0]

    def scores(self, layer: int, prev1, prev2) -> np.ndarray:
        """[E] estimated P(e chosen at `layer`) given the experts chosen at layer-1 (prev1) and
        layer-2 (prev2); each level is smoothed towards the level below with weight `smoothing`."""
        a, m = self.smoothing, self.marginal[layer]
        p = (m + a / len(m)) / (m.sum() / self.k + a)  # sums to about k over e, as the others do
        if layer < 1 or not len(prev1):
            return p
        prev1 = [int(e) for e in prev1]
        s1 = self.single[layer][prev1]  # [|S1|, E]
        n1 = self.marginal[layer - 1][prev1][:, None]  # tokens that chose a
        p1 = (s1 + a * p) / (n1 + a)
        if layer < 2 or not len(prev2):
            return p1.mean(0)
        s2 = self.pair[layer][np.ix_(prev1, [int(e) for e in prev2])]  # [|S1|, |S2|, E]
        n2 = s2.sum(2, keepdims=True) / self.k  # tokens that chose both a and b
        return ((s2 + a * p1[:, None, :]) / (n2 + a)).mean((0, 1))

    def predict(self, layer: int, prev1, prev2, n: int) -> list[int]:
        """The `n` most probable experts of `layer`, most probable first (ties to the lower id)."""
        return [int(e) for e in np.argsort(-self.scores(layer, prev1, prev2), kind="stable")[:n]]

    def save(self, path: str) -> None:
        buf = io.BytesIO()  # (numpy writes a file object; durable.py writes the bytes with os.write)
        np.savez_compressed(
            buf,
            pair=self.pair,
            single=self.single,
            marginal=self.marginal,
            k=np.array(self.k),
            model=np.array(self.model),
        )
        write_durably(path, [buf.getbuffer()], OutputError)

    @classmethod
    def load(cls, path: str, model: str) -> "RoutingPredictor":
        if not os.path.isfile(path):
            raise ModelFileError(f"{path}: no routing predictor here (run tools/trace_experts.py)")
        try:
            with np.load(path) as z:
                pred = cls(z["pair"], z["single"], z["marginal"], int(z["k"]), str(z["model"]))
        except (OSError, ValueError, KeyError) as e:
            raise ModelFileError(f"{path}: not a routing predictor file ({e})") from None
        if pred.model != model:
            raise ConfigError(
                f"{path}: routing trace of another model (recorded for {pred.model[:12]}, this model is {model[:12]})"
            )
        return pred
