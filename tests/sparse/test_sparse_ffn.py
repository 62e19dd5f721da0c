"""Sparse FFN source: with every neuron active the output equals the dense model's bit for bit in
every mode and budget (prompt and decode paths, overflow past the cache included); predictors
round-trip through the store; bad budgets and predictor files get one named error."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.budget import parse_budget
from mlx_flash.errors import ConfigError, StoreError
from mlx_flash.sparse.modes import SparseMode
from mlx_flash.sparse.predictor import LayerPredictor, Predictors

IDS = list(range(300, 332))


def run(engine, ids=IDS, prompt=24):
    """Logits of a whole prompt, then of decode steps after a shorter prompt."""
    full = engine.logits(ids)
    caches = engine.new_caches()
    engine.prefill(ids[:prompt], caches)
    steps = np.stack([engine.forward([t], caches)[-1] for t in ids[prompt:]])
    return full, steps


@pytest.fixture(scope="module")
def dense_f16(f16_store_dir):
    with mlx_flash.load(f16_store_dir, backend="torch", progress=False) as e:
        yield run(e)


# naive and hybrid read whole layers (no neuron cache): the full tier (~5 s) checks them at 55% too;
# window and all at 55% (~10 s each) share the predictor mode's selection path, and all runs at 100%
DEFAULT_AT_55 = (SparseMode.PREDICTOR,)


@pytest.mark.parametrize(
    "mode,budget",
    [pytest.param(m.value, "55%", marks=[] if m in DEFAULT_AT_55 else [pytest.mark.full]) for m in SparseMode]
    + [("all", "100%")],
)
def test_all_active_equals_dense(f16_store_dir, dense_f16, mode, budget):
    with mlx_flash.load(
        f16_store_dir,
        backend="torch",
        ffn="sparse",
        weights_budget=budget,
        progress=False,
        flash=mlx_flash.FlashOptions(mode=mode, predictor="dense"),
        io=mlx_flash.IOOptions(mode="direct"),
    ) as e:
        full, steps = run(e)
        assert np.array_equal(full, dense_f16[0]) and np.array_equal(steps, dense_f16[1])
        if mode in ("window", "all"):
            assert max(e.ffn.cached_rows()) <= e.ffn.plan.capacity < 1536 or budget == "100%"
        assert mlx_flash.memory_plan(e)["planned_total"] <= mlx_flash.memory_plan(e)["budget"]


def test_relu_family_all_active_equals_dense(tiny_store):
    store, _ = tiny_store("opt")
    ids = list(range(3, 40))
    with mlx_flash.load(store, backend="torch", progress=False) as dense:
        want = run(dense, ids, 20)
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="120%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="all", predictor="dense"),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        got = run(e, ids, 20)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def save_predictors(store, shape_of=lambda D, F: ((D, 4), (4, F), (F,)), bias=10.0, layers=None):
    from mlx_flash.store import open_store

    m = open_store(store).manifest.ffn
    D, F = m.d_model, m.n_neurons
    su, sv, sb = shape_of(D, F)
    n = len(m.layer_offsets) if layers is None else layers
    preds = [
        LayerPredictor(np.zeros(su, np.float32), np.zeros(sv, np.float32), np.full(sb, bias, np.float32), 0.0)
        for _ in range(n)
    ]
    Predictors(preds, 0.5, [0.0] * n).save(store)


def test_predictor_round_trip_and_masking(tiny_store):
    store, _ = tiny_store("llama")
    ids = list(range(3, 30))
    with mlx_flash.load(store, backend="torch", progress=False) as dense:
        want = run(dense, ids, 16)
    save_predictors(store, bias=10.0)  # every logit 10 > cut 0: all active, so exact
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="160%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="all"),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        got = run(e, ids, 16)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    save_predictors(store, bias=-10.0)  # nothing active: the FFN adds nothing, and nothing is read
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="160%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="all"),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        got = run(e, ids, 16)
        assert e.ffn.rows_loaded == 0
    assert not np.allclose(got[1], want[1])


def test_budget_below_minimum_names_the_minimum(tiny_store):
    store, _ = tiny_store("llama")
    with pytest.raises(ConfigError, match=r"weights budget 0\.0 MB .*is below the minimum [0-9.]+ MB"):
        mlx_flash.load(
            store,
            backend="torch",
            ffn="sparse",
            weights_budget="1KB",
            progress=False,
            flash=mlx_flash.FlashOptions(predictor="dense"),
        )


def test_missing_predictors_are_named(tiny_store):
    store, _ = tiny_store("llama")
    with pytest.raises(StoreError, match="no sparsity predictors .*train_predictor"):
        mlx_flash.load(
            store, backend="torch", ffn="sparse", progress=False, flash=mlx_flash.FlashOptions(mode="window")
        )
    # modes without a predictor do not need one
    mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="160%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="hybrid"),
    ).close()


def test_predictor_of_the_wrong_shape_is_named(tiny_store):
    store, _ = tiny_store("llama")
    save_predictors(store, shape_of=lambda D, F: ((D + 1, 4), (4, F), (F,)))
    with pytest.raises(StoreError, match=r"predictor of layer 0 has shapes U\[65, 4\]"):
        mlx_flash.load(store, backend="torch", ffn="sparse", progress=False)
    save_predictors(store, layers=1)
    with pytest.raises(StoreError, match=r"predictor tensor layers\.1\.U is missing"):
        mlx_flash.load(store, backend="torch", ffn="sparse", progress=False)


def test_budget_strings():
    assert parse_budget("50%", 1000) == 500
    assert parse_budget("1.5GiB", 0) == 3 * 2**29
    assert parse_budget("300MB", 0) == 300 * 10**6
    with pytest.raises(ConfigError, match="not understood"):
        parse_budget("lots", 10)


def test_gate_predictor_selects_by_the_ffn_own_activations(tiny_store):
    """Threshold 0: every neuron with a nonzero activation is selected, so the output is the dense
    one bit for bit; a huge threshold selects nothing and reads nothing."""
    store, _ = tiny_store("llama")
    ids = list(range(3, 30))
    with mlx_flash.load(store, backend="torch", progress=False) as dense:
        want = run(dense, ids, 16)
    for threshold, exact in ((0.0, True), (1e9, False)):
        save_predictors(store)
        meta_path = f"{store}/predictors.json"
        import json

        meta = json.load(open(meta_path))
        meta["magnitude_thresholds"] = [threshold] * len(meta["magnitude_thresholds"])
        json.dump(meta, open(meta_path, "w"))
        with mlx_flash.load(
            store,
            backend="torch",
            ffn="sparse",
            weights_budget="160%",
            progress=False,
            flash=mlx_flash.FlashOptions(mode="all", predictor="gate"),
            io=mlx_flash.IOOptions(mode="buffered"),
        ) as e:
            got = run(e, ids, 16)
            assert mlx_flash.memory_plan(e)["predictors"] > 0
            if not exact:
                assert e.ffn.rows_loaded == 0
        same = np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert same == exact


def test_down_only_reads_a_third_and_stays_close(tiny_store):
    """Down-only: gate/up from the resident 4-bit copy (bfloat16 activations in torch's int4 kernel),
    only down columns read. Prompt and decode paths agree with each other; both stay close to the
    dense model; a cached row is down-column bytes only."""
    import json

    store, _ = tiny_store("llama")
    ids = list(range(3, 30))
    with mlx_flash.load(store, backend="torch", progress=False) as dense:
        want = run(dense, ids, 16)
    save_predictors(store)
    meta = json.load(open(f"{store}/predictors.json"))
    meta["magnitude_thresholds"] = [0.0] * len(meta["magnitude_thresholds"])
    json.dump(meta, open(f"{store}/predictors.json", "w"))
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="160%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="all", predictor="gate", down_only=True),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        full, steps = run(e, ids, 16)
        lay = e.ffn.layout
        down_bytes = sum(f.nbytes for f in lay.fields if f.name.startswith("down."))
        assert e.ffn.caches[0].row_bytes == down_bytes < lay.bundle_bytes
    assert np.abs(full[16:] - steps).max() < 1e-2  # the two paths compute the same thing
    assert np.abs(full - want[0]).max() < 0.1 * np.abs(want[0]).max()


def test_down_only_needs_the_gate_predictor(tiny_store):
    store, _ = tiny_store("llama")
    with pytest.raises(ConfigError, match="down-only reads need .* gate predictor"):
        mlx_flash.load(
            store,
            backend="torch",
            ffn="sparse",
            weights_budget="160%",
            progress=False,
            flash=mlx_flash.FlashOptions(predictor="dense", down_only=True),
        )
