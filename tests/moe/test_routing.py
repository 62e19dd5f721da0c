"""The next-layer expert predictor as decoding uses it: a predictor file of another model is refused,
a streamed model that preloads gives the resident model's tokens and logits bit for bit, and wrong
guesses leave the reader queue before a demand read."""

import os

import numpy as np
import pytest

import mlx_flash
import tiny_models
from greedy import greedy
from mlx_flash.calibrate.routes import fit_routing_predictor, record_routes
from mlx_flash.errors import ConfigError, ModelFileError
from mlx_flash.moe.routing import PREDICTOR_FILE, RoutingPredictor, model_id


def uniform_predictor(model: str, layers: int, experts: int = 4) -> RoutingPredictor:
    """Counts that favour no expert: these tests are about whose predictor it is, not its guesses."""
    E = experts
    return RoutingPredictor(
        np.ones((layers, E, E, E), np.float32),
        np.ones((layers, E, E), np.float32),
        np.ones((layers, E), np.float32),
        1,
        model,
    )


def test_predictor_file_of_another_model_is_refused(tmp_path):
    path = str(tmp_path / PREDICTOR_FILE)
    uniform_predictor("a" * 64, 3).save(path)
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
        fit_routing_predictor(routes, model_id(e.store), 4).save(os.path.join(store, PREDICTOR_FILE))
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="stream",
        weights_budget="1GB",
        progress=False,
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        a = mlx_flash.memory_plan(e)
    budget = a["resident_weights"] + 6 * a["slot_bytes"]  # 6 of 16 experts
    for preload in (-1, 0):
        with mlx_flash.load(
            store,
            backend="torch",
            ffn="stream",
            weights_budget=budget,
            progress=False,
            experts=mlx_flash.ExpertOptions(preload=preload),
            io=mlx_flash.IOOptions(mode="buffered"),
        ) as e:
            got = greedy(e, prompt, 64)
            f = e.ffn
            assert (f.preload, f.predicted > 0) == ((2, True) if preload else (0, False))
            assert f.useful <= f.predicted and f.stats().routed_experts == 64 * 4 * 2
        assert got[0] == want[0]
        assert np.array_equal(got[1], want[1])


def test_wrong_preloads_are_withdrawn_before_the_demand_read_and_the_tokens_stay_exact(tiny_store, monkeypatch):
    """One slow reader: a preload still queued when the next layer's demand read comes is taken off
    the queue (its slot freed), one already reading runs on behind it, and the tokens are the
    resident model's."""
    import time

    import mlx_flash.store.reader_pool as rp

    store, _ = tiny_store("qwen3_moe", num_hidden_layers=4)
    prompt = tiny_models.random_ids(10, seed=3)
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        want = greedy(e, prompt, 24)
        uniform_predictor(model_id(e.store), 4, e.args.num_experts).save(os.path.join(store, PREDICTOR_FILE))
    real = rp._preadv

    def slow(fd, bufs, offset):
        time.sleep(0.002)
        return real(fd, bufs, offset)

    monkeypatch.setattr(rp, "_preadv", slow)
    with mlx_flash.load(store, backend="torch", ffn="stream", weights_budget="1GB", progress=False) as e:
        a = mlx_flash.memory_plan(e)
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="stream",
        weights_budget=a["resident_weights"] + 8 * a["slot_bytes"],
        progress=False,
        experts=mlx_flash.ExpertOptions(preload=4),
        io=mlx_flash.IOOptions(mode="buffered", threads=1),
    ) as e:
        got = greedy(e, prompt, 24)
        st = e.ffn.stats()
    assert st.preloads_withdrawn > 0
    assert got[0] == want[0]
    assert np.array_equal(got[1], want[1])


def test_load_refuses_a_predictor_of_another_model(tiny_store):
    store, _ = tiny_store("mixtral")
    uniform_predictor("0" * 64, 2).save(os.path.join(store, PREDICTOR_FILE))
    with pytest.raises(ConfigError, match="routing trace of another model"):
        mlx_flash.load(
            store,
            backend="torch",
            ffn="stream",
            weights_budget="100%",
            progress=False,
            experts=mlx_flash.ExpertOptions(preload=-1),
        )
    with mlx_flash.load(store, backend="torch", ffn="stream", weights_budget="100%", progress=False) as e:
        assert e.ffn.preload == 0  # preloading is off by default: the predictor file is not read
