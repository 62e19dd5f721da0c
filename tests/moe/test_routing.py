"""The next-layer expert predictor (EdgeMoE's P(e at l | experts at l-1, l-2)) and preloading:
it learns planted routing dependencies, refuses a trace of another model, and a streamed model that
preloads gives the resident model's tokens and logits bit for bit."""

import os

import numpy as np
import pytest

import mlx_flash
import tiny_models
from greedy import greedy
from mlx_flash.errors import ConfigError, ModelFileError
from mlx_flash.moe.routing import PREDICTOR_FILE, RoutingPredictor, decode_trace, model_id, record_routes


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
    p = RoutingPredictor.fit(routes, "m", 8)
    acc = p.accuracy(chain(200, 6, 8, lambda a, b, layer: perm[a], seed=2))
    assert acc["per_layer"][2:] == [1.0] * 4  # layer 1 is random by construction


def test_predictor_uses_two_layers_back():
    rule = lambda a, b, layer: (a + b) % 4  # noqa: E731  neither layer alone says anything
    p = RoutingPredictor.fit(chain(2000, 5, 4, rule), "m", 4)
    acc = p.accuracy(chain(300, 5, 4, rule, seed=3))
    assert acc["per_layer"][2:] == [1.0] * 3
    assert acc["per_layer"][1] < 0.5


def test_scores_are_probabilities_over_the_experts():
    routes = np.stack([np.random.default_rng(s).permuted(np.tile(np.arange(6), (50, 1)), axis=1)[:, :2]
                       for s in range(4)]).astype(np.int16)  # [4, 50, 2]
    p = RoutingPredictor.fit(routes, "m", 6)
    for layer in range(4):
        s = p.scores(layer, routes[layer - 1, 0] if layer else (), routes[layer - 2, 0] if layer > 1 else ())
        assert s.min() > 0 and abs(s.sum() - 2) < 0.2  # K = 2 experts per token


def test_decode_trace_is_token_major():
    routes = np.array([[[0, 1], [2, 3]], [[1, 0], [3, 2]]], np.int16)  # [L=2, N=2, K=2]
    assert decode_trace(routes) == [(0, [0, 1]), (1, [0, 1]), (0, [2, 3]), (1, [2, 3])]


def test_predictor_file_of_another_model_is_refused(tmp_path):
    path = str(tmp_path / PREDICTOR_FILE)
    RoutingPredictor.fit(chain(50, 3, 4, lambda a, b, layer: a), "a" * 64, 4).save(path)
    assert RoutingPredictor.load(path, "a" * 64).k == 1
    with pytest.raises(ConfigError, match="routing trace of another model"):
        RoutingPredictor.load(path, "b" * 64)
    with open(path, "wb") as fh:
        fh.write(b"not a predictor")
    with pytest.raises(ModelFileError, match="not a routing predictor file"):
        RoutingPredictor.load(path, "a" * 64)


def test_preloading_streams_exactly_and_counts_its_guesses(tiny_store):
    store, _ = tiny_store("qwen3_moe", num_hidden_layers=4)
    prompt = tiny_models.random_ids(10, seed=3)
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        want = greedy(e, prompt, 64)
        routes = record_routes(e, tiny_models.random_ids(400, seed=9), context=64)
        RoutingPredictor.fit(routes, model_id(e.store), 4).save(os.path.join(store, PREDICTOR_FILE))
    with mlx_flash.load(store, backend="torch", ffn="stream", memory_budget="1GB", io_mode="buffered",
                        progress=False) as e:
        a = e.ffn.account
    budget = a["resident_weights"] + 6 * a["slot_bytes"]  # 6 of 16 experts
    for preload in (-1, 0):
        with mlx_flash.load(store, backend="torch", ffn="stream", memory_budget=budget, io_mode="buffered",
                            expert_preload=preload, progress=False) as e:
            got = greedy(e, prompt, 64)
            f = e.ffn
            assert (f.preload, f.predicted > 0) == ((2, True) if preload else (0, False))
            assert f.useful <= f.predicted and f.routed_experts == 64 * 4 * 2
        assert got[0] == want[0]
        assert np.array_equal(got[1], want[1])


def test_load_refuses_a_predictor_of_another_model(tiny_store):
    store, _ = tiny_store("mixtral")
    RoutingPredictor.fit(chain(50, 2, 4, lambda a, b, layer: a), "0" * 64, 4).save(os.path.join(store, PREDICTOR_FILE))
    with pytest.raises(ConfigError, match="routing trace of another model"):
        mlx_flash.load(store, backend="torch", ffn="stream", memory_budget="100%", progress=False)
