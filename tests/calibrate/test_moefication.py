"""MoEfication (the derived real-weights MoE): balanced clusters, the router, and a derived model
whose every expert runs equals the dense model it came from."""

import json
import os

import numpy as np
import pytest

import mlx_flash
import tiny_models
from greedy import greedy
from mlx_flash.errors import ConfigError
from mlx_flash.calibrate import moefication as M
from mlx_flash.calibrate.derive_moe import moefy


def test_balanced_clusters_recover_planted_coactivation_groups():
    rng = np.random.default_rng(0)
    E, Fe, N = 4, 8, 400
    truth = np.repeat(np.arange(E), Fe)
    rng.shuffle(truth)
    topic = rng.integers(0, E, N)  # each token wakes one group
    patterns = (truth[:, None] == topic[None, :]) * rng.uniform(0.5, 1.0, (E * Fe, N)) + rng.uniform(
        0, 0.1, (E * Fe, N)
    )
    got = M.balanced_clusters(patterns, E)
    assert np.bincount(got, minlength=E).tolist() == [Fe] * E
    for e in range(E):  # each found expert is exactly one planted group
        assert len(set(truth[got == e])) == 1
    order = M.expert_order(got, E)
    assert sorted(order.tolist()) == list(range(E * Fe))
    with pytest.raises(ValueError):
        M.balanced_clusters(patterns[:-1], E)


def test_router_learns_which_experts_matter():
    rng = np.random.default_rng(1)
    N, D, E = 3000, 16, 6
    x = rng.standard_normal((N, D)).astype(np.float32)
    W = rng.standard_normal((E, D)).astype(np.float32)
    scores = np.exp(x @ W.T)  # the true share of each expert grows with a hidden linear score
    router = M.train_router(x[:2500], scores[:2500], epochs=20)
    q = M.router_quality(router, x[2500:], scores[2500:], k=2)
    assert q["oracle_recall"] > 0.9
    assert q["covered"] <= q["oracle_covered"] + 1e-6


@pytest.fixture
def dense_dir(tmp_path):
    tiny_models.build("llama", str(tmp_path / "dense"))
    return str(tmp_path / "dense")


def calib_text(n: int = 600) -> str:
    return " ".join(f"w{i}" for i in tiny_models.random_ids(n, seed=5))


def test_moefied_model_with_every_expert_equals_the_dense_model(dense_dir, tmp_path):
    out = str(tmp_path / "moe-all")
    report = moefy(
        dense_dir,
        out,
        calib_text(),
        n_experts=4,
        top_k=4,
        epochs=2,
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        log=None,
    )
    with open(os.path.join(out, "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["model_type"] == "moefied_llama" and cfg["moefication"]["derived_from"] == "dense"
    assert len(report["router"]) == 2
    ids = tiny_models.random_ids(16, seed=2)
    kw = dict(backend="torch", cache_dir=str(tmp_path / "cache"), progress=False)
    with mlx_flash.load(dense_dir, **kw) as e:
        want = np.asarray(e.forward(ids, e.new_caches(), all_logits=True))
    with mlx_flash.load(out, **kw) as e:
        assert e.store.manifest.ffn.n_experts == 4
        got = np.asarray(e.forward(ids, e.new_caches(), all_logits=True))
    assert np.abs(got - want).max() < 1e-4  # same neurons, summed in expert order


def test_moefied_model_with_fewer_experts_streams_exactly(dense_dir, tmp_path):
    out = str(tmp_path / "moe-2of4")
    moefy(
        dense_dir,
        out,
        calib_text(),
        n_experts=4,
        top_k=2,
        epochs=2,
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        log=None,
    )
    kw = dict(backend="torch", cache_dir=str(tmp_path / "cache"), progress=False)
    prompt = tiny_models.random_ids(8, seed=4)

    with mlx_flash.load(out, **kw) as e:
        want = greedy(e, prompt, 24)
    with mlx_flash.load(out, ffn="stream", weights_budget="1GB", **kw, io=mlx_flash.IOOptions(mode="buffered")) as e:
        a = mlx_flash.memory_plan(e)
    budget = a["resident_weights"] + 3 * a["slot_bytes"]
    with mlx_flash.load(out, ffn="stream", weights_budget=budget, **kw, io=mlx_flash.IOOptions(mode="buffered")) as e:
        got = greedy(e, prompt, 24)
        assert e.ffn.cache.slots == 3  # fewer slots than the 2 layers x 4 experts
    assert got[0] == want[0] and np.array_equal(got[1], want[1])


def test_moefy_refuses_bad_options(dense_dir, tmp_path):
    with pytest.raises(ConfigError, match="top_k 5 is not in 1..n_experts"):
        moefy(dense_dir, str(tmp_path / "x"), calib_text(), n_experts=4, top_k=5, progress=False, log=None)
    with pytest.raises(ConfigError, match="do not split evenly into 5 experts"):
        moefy(dense_dir, str(tmp_path / "x"), calib_text(), n_experts=5, top_k=2, progress=False, log=None)
    assert not os.path.exists(tmp_path / "x")
