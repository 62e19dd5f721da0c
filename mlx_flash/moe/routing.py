"""Routing paths and the next-layer expert predictor (EdgeMoE §6, "prediction + preload").

A routing trace is what the router chose for each token at each MoE layer, routes [L, N, K].
From traces of calibration text, `RoutingPredictor` estimates P(expert e at layer l | a chosen at
l-1, b chosen at l-2); a token that chose sets S1 at l-1 and S2 at l-2 scores e by the mean of that
probability over the pairs (a, b) in S1 x S2. Pairs seen rarely fall back to P(e | a) and then to
P(e at l) (additive smoothing), so every layer, including 0 and 1, has a ranking.

Both are saved with the store's model id (the checksum of its resident weights, which hold the
routers): loading them for another model is refused with the two ids named.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import ConfigError, ModelFileError
from ..ffn_source import WrappedSource

PREDICTOR_FILE = "routing_predictor.npz"  # in the store directory


def model_id(store) -> str:
    """Routing depends on the routers, which live in the resident weights: their checksum names the model."""
    from ..store.converter import RESIDENT_FILE

    return store.manifest.files[RESIDENT_FILE]["sha256"]


class RecordingExperts(WrappedSource):
    """Wraps an expert source and keeps every token's routing, per layer."""

    def __init__(self, inner, n_layers: int):
        super().__init__(inner)
        self.routes: list[list[np.ndarray]] = [[] for _ in range(n_layers)]

    def routed(self, layer: int, ids: np.ndarray) -> None:
        self.routes[layer].append(np.asarray(ids, dtype=np.int16))
        self.inner.routed(layer, ids)

    def experts(self, layer: int, ids: list[int]):
        return self.inner.experts(layer, ids)

    def trace(self) -> np.ndarray:
        return np.stack([np.concatenate(r) for r in self.routes])  # [L, N, K]


def record_routes(engine, ids: list[int], context: int = 512, progress: bool = False) -> np.ndarray:
    """routes [L, N, K] of `ids` fed in independent windows of `context` tokens."""
    from tqdm import tqdm

    rec = RecordingExperts(engine.ffn, engine.args.num_hidden_layers)
    inner, engine.ffn = engine.ffn, rec
    try:
        for s in tqdm(range(0, len(ids), context), desc="routing", unit="window", disable=not progress):
            if ids[s:s + context]:
                engine.forward(ids[s:s + context], engine.new_caches(), all_logits=True)
    finally:
        engine.ffn = inner
    return rec.trace()


def decode_trace(routes: np.ndarray) -> list[tuple[int, list[int]]]:
    """The expert accesses of decoding these tokens one by one: [(layer, experts), ...] token-major."""
    L, N, _ = routes.shape
    return [(layer, sorted(int(e) for e in routes[layer, n])) for n in range(N) for layer in range(L)]


class RoutingPredictor:
    def __init__(self, pair: np.ndarray, single: np.ndarray, marginal: np.ndarray, k: int, model: str,
                 smoothing: float = 1.0):
        self.pair = pair  # [L, E(a at l-1), E(b at l-2), E] tokens with a, b before and e at l
        self.single = single  # [L, E(a at l-1), E] tokens with a before and e at l
        self.marginal = marginal  # [L, E] tokens with e at l
        self.k = k  # experts per token
        self.model = model
        self.smoothing = smoothing

    @property
    def n_layers(self) -> int:
        return self.marginal.shape[0]

    @classmethod
    def fit(cls, routes: np.ndarray, model: str, n_experts: int) -> "RoutingPredictor":
        L, N, K = routes.shape
        E = n_experts
        onehot = np.zeros((L, N, E), np.float32)
        np.put_along_axis(onehot, routes.astype(np.int64), 1.0, axis=2)
        marginal = onehot.sum(1)
        single = np.zeros((L, E, E), np.float32)
        pair = np.zeros((L, E, E, E), np.float32)
        for layer in range(1, L):
            single[layer] = onehot[layer - 1].T @ onehot[layer]
            if layer >= 2:
                ab = (onehot[layer - 1][:, :, None] * onehot[layer - 2][:, None, :]).reshape(N, E * E)
                pair[layer] = (ab.T @ onehot[layer]).reshape(E, E, E)
        return cls(pair, single, marginal, K, model)

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

    def accuracy(self, routes: np.ndarray, n: int | None = None) -> dict:
        """On a trace [L, N, K]: the share of each token's routed experts (layers >= 1) that the top-n
        prediction (n = K by default) contained, overall and per layer."""
        L, N, K = routes.shape
        n = n or K
        per_layer = [0.0]
        for layer in range(1, L):
            got = 0
            for t in range(N):
                prev2 = routes[layer - 2, t] if layer >= 2 else ()
                guess = set(self.predict(layer, routes[layer - 1, t], prev2, n))
                got += len(guess & set(int(e) for e in routes[layer, t]))
            per_layer.append(got / (N * K))
        return {"accuracy": float(np.mean(per_layer[1:])), "per_layer": per_layer, "predicted": n}

    def save(self, path: str) -> None:
        tmp = path + ".tmp.npz"
        np.savez_compressed(tmp, pair=self.pair, single=self.single, marginal=self.marginal, k=np.array(self.k),
                            model=np.array(self.model))
        os.replace(tmp, path)

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
            raise ConfigError(f"{path}: routing trace of another model (recorded for {pred.model[:12]}, "
                              f"this model is {model[:12]})")
        return pred
