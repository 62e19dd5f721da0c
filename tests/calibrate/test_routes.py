"""Fitting the next-layer expert predictor (EdgeMoE's P(e at l | experts at l-1, l-2)) on routing
traces: it learns planted routing dependencies, its scores are probabilities, and a trace replays as
token-major expert accesses."""

import numpy as np

from mlx_flash.calibrate.routes import decode_trace, fit_routing_predictor, routing_accuracy


def chain(N, L, E, rule, seed=0):
    rng = np.random.default_rng(seed)
    r = np.zeros((L, N, 1), np.int16)
    r[0, :, 0], r[1, :, 0] = rng.integers(0, E, N), rng.integers(0, E, N)
    for layer in range(2, L):
        r[layer, :, 0] = rule(r[layer - 1, :, 0], r[layer - 2, :, 0], layer)
    return r


def test_predictor_learns_a_first_order_chain():
    perm = np.random.default_rng(1).permutation(8)
    routes = chain(500, 6, 8, lambda a, b, layer: perm[a])
    p = fit_routing_predictor(routes, "m", 8)
    acc = routing_accuracy(p, chain(200, 6, 8, lambda a, b, layer: perm[a], seed=2))
    assert acc["per_layer"][2:] == [1.0] * 4  # layer 1 is random by construction


def test_predictor_uses_two_layers_back():
    rule = lambda a, b, layer: (a + b) % 4  # noqa: E731  neither layer alone says anything
    p = fit_routing_predictor(chain(2000, 5, 4, rule), "m", 4)
    acc = routing_accuracy(p, chain(300, 5, 4, rule, seed=3))
    assert acc["per_layer"][2:] == [1.0] * 3
    assert acc["per_layer"][1] < 0.5


def test_scores_are_probabilities_over_the_experts():
    routes = np.stack(
        [np.random.default_rng(s).permuted(np.tile(np.arange(6), (50, 1)), axis=1)[:, :2] for s in range(4)]
    ).astype(np.int16)  # [4, 50, 2]
    p = fit_routing_predictor(routes, "m", 6)
    for layer in range(4):
        s = p.scores(layer, routes[layer - 1, 0] if layer else (), routes[layer - 2, 0] if layer > 1 else ())
        assert s.min() > 0 and abs(s.sum() - 2) < 0.2  # K = 2 experts per token


def test_decode_trace_is_token_major():
    routes = np.array([[[0, 1], [2, 3]], [[1, 0], [3, 2]]], np.int16)  # [L=2, N=2, K=2]
    assert decode_trace(routes) == [(0, [0, 1]), (1, [0, 1]), (0, [2, 3]), (1, [2, 3])]
