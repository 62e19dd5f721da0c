"""Routing paths of a MoE model on calibration text, and the next-layer expert predictor fitted to
them (EdgeMoE §6, "prediction + preload"; tools/trace_experts.py).

A routing trace is what the router chose for each token at each MoE layer, routes [L, N, K]. The
predictor (moe/routing.py, which decoding loads to preload experts) is the counts of the experts
chosen at l-1 and l-2 against those chosen at l; `fit_routing_predictor` counts them on a trace and
`routing_accuracy` measures its top-n guesses on another.
"""

from __future__ import annotations

import numpy as np

from ..ffn_source import WrappedExpertSource
from ..moe.routing import RoutingPredictor


class RecordingExperts(WrappedExpertSource):
    """Wraps an expert source and keeps every token's routing, per layer."""

    def __init__(self, inner, n_layers: int):
        super().__init__(inner)
        self.routes: list[list[np.ndarray]] = [[] for _ in range(n_layers)]

    def waves(self, layer: int, routing: np.ndarray):
        self.routes[layer].append(np.asarray(routing, dtype=np.int16))
        return self.inner.waves(layer, routing)

    def trace(self) -> np.ndarray:
        return np.stack([np.concatenate(r) for r in self.routes])  # [L, N, K]


def record_routes(engine, ids: list[int], context: int = 512, progress: bool = False) -> np.ndarray:
    """routes [L, N, K] of `ids` fed in independent windows of `context` tokens."""
    from tqdm import tqdm

    rec = RecordingExperts(engine.ffn, engine.args.num_hidden_layers)
    inner, engine.ffn = engine.ffn, rec
    try:
        for s in tqdm(range(0, len(ids), context), desc="routing", unit="window", disable=not progress):
            if ids[s : s + context]:
                engine.forward(ids[s : s + context], engine.new_caches(), all_logits=True)
    finally:
        engine.ffn = inner
    return rec.trace()


def record_teacher_forced(engine, ids: list[int], prompt: int) -> np.ndarray:
    """routes [L, N, K] of the N = len(ids) - prompt tokens after a `prompt`-token prefill, each fed
    one at a time as decoding feeds its own pick (teacher forcing: the next token is the text's,
    so routing follows real text whatever the model would have chosen)."""
    rec = RecordingExperts(engine.ffn, engine.args.num_hidden_layers)
    inner, engine.ffn = engine.ffn, rec
    try:
        caches = engine.new_caches()
        engine.prefill(ids[:prompt], caches)
        rec.routes = [[] for _ in rec.routes]  # the decode steps only
        for t in ids[prompt:]:
            engine.forward([t], caches)
        engine.release(caches)
    finally:
        engine.ffn = inner
    return rec.trace()


def routing_spread(routes: np.ndarray, n_experts: int) -> list[dict]:
    """Per layer of a trace [L, N, K] of consecutive tokens: `used`, the share of the layer's experts
    any token chose; `overlap`, the mean share of a token's experts the next token chose too; `top`,
    the largest share of the tokens one expert served. A trained model's routing spreads (most
    experts used, little overlap, no expert in most tokens); routing that collapses onto a few
    experts lets any cache look good."""
    out = []
    for layer in routes:
        sets = [set(int(e) for e in row) for row in layer]
        k = layer.shape[1]
        overlap = [len(a & b) / k for a, b in zip(sets, sets[1:])]
        counts = np.bincount(layer.reshape(-1).astype(np.int64), minlength=n_experts)
        out.append(
            {
                "used": len(set().union(*sets)) / n_experts,
                "overlap": float(np.mean(overlap)) if overlap else 0.0,
                "top": float(counts.max() / len(sets)),
            }
        )
    return out


def decode_trace(routes: np.ndarray) -> list[tuple[int, list[int]]]:
    """The expert accesses of decoding these tokens one by one: [(layer, experts), ...] token-major."""
    L, N, _ = routes.shape
    return [(layer, sorted(int(e) for e in routes[layer, n])) for n in range(N) for layer in range(L)]


def fit_routing_predictor(routes: np.ndarray, model: str, n_experts: int) -> RoutingPredictor:
    """Count, on a trace [L, N, K], each expert at layer l against the experts the same token chose at
    l-1 (single) and at l-1 and l-2 together (pair), and each expert's own frequency (marginal)."""
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
    return RoutingPredictor(pair, single, marginal, K, model)


def routing_accuracy(pred: RoutingPredictor, routes: np.ndarray, n: int | None = None) -> dict:
    """On a trace [L, N, K]: the share of each token's routed experts (layers >= 1) that the top-n
    prediction (n = K by default) contained, overall and per layer."""
    L, N, K = routes.shape
    n = n or K
    per_layer = [0.0]
    for layer in range(1, L):
        got = 0
        for t in range(N):
            prev2 = routes[layer - 2, t] if layer >= 2 else ()
            guess = set(pred.predict(layer, routes[layer - 1, t], prev2, n))
            got += len(guess & set(int(e) for e in routes[layer, t]))
        per_layer.append(got / (N * K))
    return {"accuracy": float(np.mean(per_layer[1:])), "per_layer": per_layer, "predicted": n}
