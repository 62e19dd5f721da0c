"""Predictor training end to end on a tiny model: labels from real activations of that model, cuts
for several recalls saved with the predictors, and the engine picks the one asked for."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.errors import StoreError
from mlx_flash.calibrate import predictor_training as P
from mlx_flash.calibrate.activations import magnitude_thresholds
from mlx_flash.calibrate.predictor_training import train_predictors


def test_calibrated_cut_meets_recall_on_its_data():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((400, 8)).astype(np.float32)
    W = rng.standard_normal((8, 16)).astype(np.float32)
    Y = X @ W > 0.5
    p = P.train_layer(X, Y, rank=8, epochs=30, batch=64)
    for r in (0.8, 0.95):
        p.cut = P.calibrate_cut(p, X, Y, r)
        assert P.evaluate(p, X, Y)["recall"] >= r - 1e-9
    assert P.evaluate(p, X, Y)["precision"] > Y.mean()  # better than guessing


def test_thresholds_hit_the_target_sparsity():
    mags = [np.abs(np.random.default_rng(i).standard_normal((100, 50))).astype(np.float16) for i in range(2)]
    t = magnitude_thresholds(mags, 0.7)
    for m, ti in zip(mags, t):
        assert abs((m.astype(np.float32) > ti).mean() - 0.3) < 0.01


def test_train_save_load_and_pick_recall(tiny_store):
    store, _ = tiny_store("llama")
    ids = list(np.random.default_rng(0).integers(3, 90, 600))
    with mlx_flash.load(store, backend="torch", progress=False) as eng:
        preds = train_predictors(
            eng,
            ids[:512],
            ids[512:],
            sparsity=0.5,
            rank=4,
            max_rank=4,
            recall=0.9,
            calib_tokens=512,
            valid_tokens=88,
            epochs=2,
            log=None,
        )
        preds.save(store)
    assert set(preds.cuts_by_recall) == {"0.8", "0.9", "0.95", "0.99"}
    assert all(0 <= m["recall"] <= 1 and 0 <= m["precision"] <= 1 for m in preds.metrics)
    cuts = {}
    for r in (0.8, 0.99):
        with mlx_flash.load(
            store,
            backend="torch",
            ffn="sparse",
            weights_budget="160%",
            progress=False,
            flash=mlx_flash.FlashOptions(recall=r),
            io=mlx_flash.IOOptions(mode="buffered"),
        ) as e:
            cuts[r] = [p.cut for p in e.ffn.selector.p.layers]
            e.generate("w1 w2 w3", max_tokens=4)
    assert all(a >= b for a, b in zip(cuts[0.8], cuts[0.99]))  # higher recall: lower cut, more neurons
    with pytest.raises(StoreError, match="no cut for recall 0.5"):
        mlx_flash.load(
            store,
            backend="torch",
            ffn="sparse",
            weights_budget="160%",
            progress=False,
            flash=mlx_flash.FlashOptions(recall=0.5),
        )


def test_quantize4_is_exact_on_a_four_bit_grid():
    """A dequantized Q4_1-style tensor (per group: scale * q + min, with q spanning 0..15) comes back
    exactly, so the gate predictor of a float16 store made from a 4-bit GGUF selects by the model's
    own weights."""
    import mlx.core as mx

    from mlx_flash.sparse.gateup import quantize4

    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (16, 64))
    q[:, ::32] = 0
    q[:, 1::32] = 15
    scale = rng.uniform(0.01, 0.1, (16, 2)).astype(np.float16).astype(np.float32)
    lo = rng.uniform(-1, 0, (16, 2)).astype(np.float16).astype(np.float32)
    # as a float16 store holds it: each value rounded to float16
    w = (q.reshape(16, 2, 32) * scale[..., None] + lo[..., None]).reshape(16, 64).astype(np.float16)
    p = quantize4(w.astype(np.float32))
    back = np.array(
        mx.dequantize(mx.array(p["weight"]), mx.array(p["scales"]), mx.array(p["biases"]), group_size=32, bits=4)
    )
    assert back.dtype == np.float16
    worst = np.abs(back.astype(np.float32) - w.astype(np.float32)).max()
    assert worst <= np.abs(w.astype(np.float32)).max() * 2**-10  # at most one float16 rounding step
