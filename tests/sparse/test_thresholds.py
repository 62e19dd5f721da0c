"""Activation-sparsity thresholds: measured on text by the calibration, saved beside the store, read
back only when they are whole and of that store, and applied by load(..., sparsity=s)."""

import json
import os

import numpy as np
import pytest

import mlx_flash
from mlx_flash.calibrate.thresholds import BINS, calibrate, histogram, quantiles
from mlx_flash.errors import ConfigError, StoreError
from mlx_flash.sparse.thresholds import PERCENTS, ROLES, load_thresholds, save_thresholds, thresholds_path

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40


def test_quantiles_of_the_histogram_are_numpy_quantiles_to_the_bin_width():
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    q = quantiles(histogram(x))
    want = np.quantile(np.abs(x), np.arange(PERCENTS) / 100)
    assert q[0] == 0 and np.all(np.diff(q) >= 0)
    np.testing.assert_allclose(q[1:], want[1:], rtol=3e-3)  # 1,000 bins a decade: 0.23% wide
    assert histogram(np.zeros(5)).sum() == 5 and histogram(np.zeros(5))[0] == 5 and len(histogram(x)) == BINS


@pytest.fixture
def calibrated(tiny_store):
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False) as e:
        found = calibrate(e, TEXT, tokens=256, context=64, progress=False)
        save_thresholds(e.store, found)
        n_layers = e.args.num_hidden_layers
    return store, found, n_layers


def test_thresholds_round_trip_and_levels_interpolate(calibrated):
    store, found, n_layers = calibrated
    again = load_thresholds(mlx_flash.store.open_store(store), n_layers)
    for r in ROLES:
        np.testing.assert_allclose(again.quantiles[r], found.quantiles[r], rtol=1e-6)
    at40, at41, at405 = found.at(0.40), found.at(0.41), found.at(0.405)
    for r in ROLES:
        np.testing.assert_allclose(at40[r], found.quantiles[r][:, 40])
        np.testing.assert_allclose(at405[r], (at40[r] + at41[r]) / 2, rtol=1e-6)
        assert np.all(found.at(0.0)[r] == 0)
    with pytest.raises(ConfigError, match="outside"):
        found.at(0.97)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "another-store", "missing"])
def test_a_wrong_thresholds_file_is_refused_in_one_line(calibrated, damage):
    store, _, n_layers = calibrated
    opened = mlx_flash.store.open_store(store)
    path = thresholds_path(opened)
    raw = bytearray(open(path, "rb").read())
    if damage == "flipped":
        i = raw.index(b'"quantiles"') + 40  # a digit inside the numbers: the checksum no longer matches
        raw[i] = ord("7") if raw[i] != ord("7") else ord("3")
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "another-store":  # a whole, checksummed file naming another store
        d = json.loads(bytes(raw))
        d.pop("checksum")
        d["store"] = "0" * 64
        found = mlx_flash.sparse.thresholds.Thresholds(
            {r: np.asarray(d["quantiles"][r], np.float32) for r in ROLES}, d["store"], d["calibration"]
        )
        raw = bytearray(found.to_json())
    if damage == "missing":
        os.remove(path)
    else:
        open(path, "wb").write(bytes(raw))
    with pytest.raises(StoreError) as e:
        mlx_flash.load(store, backend="torch", ffn="resident", sparsity=0.4, progress=False)
    line = str(e.value)
    assert "\n" not in line and ("sparsify" in line)
    assert {
        "flipped": "checksum",
        "truncated": "unreadable",
        "another-store": "another store",
        "missing": "no sparsity",
    }[damage] in line


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_sparsity_zero_is_the_dense_model_and_a_level_changes_every_row_only_when_asked(calibrated, backend):
    store, _, _ = calibrated
    ids = list(range(3, 40))
    with mlx_flash.load(store, backend=backend, ffn="resident", progress=False) as e:
        dense = e.logits(ids)
    with mlx_flash.load(store, backend=backend, ffn="resident", sparsity=0.0, progress=False) as e:
        assert e.thresholded == () and np.array_equal(e.logits(ids), dense)
    with mlx_flash.load(store, backend=backend, ffn="resident", sparsity=0.5, progress=False) as e:
        assert len(e.thresholded) == 4 * e.args.num_hidden_layers
        assert np.array_equal(e.logits(ids), dense)  # a prompt's rows run dense
        one = e.forward(ids[:1], e.new_caches())  # a one-row step is thresholded
        assert not np.allclose(one, dense[:1], atol=1e-4)
    with mlx_flash.load(store, backend=backend, ffn="resident", sparsity=0.5, sparsity_rows="all", progress=False) as e:
        every = e.logits(ids)
        assert not np.allclose(every, dense, atol=1e-4)
        np.testing.assert_allclose(every[:1], one, rtol=1e-4, atol=1e-4)


def test_sparsity_is_refused_where_it_cannot_apply(calibrated, tiny_store):
    store, _, _ = calibrated
    with pytest.raises(ConfigError, match="sparsity must be in"):
        mlx_flash.load(store, backend="torch", ffn="resident", sparsity=1.5, progress=False)
    with pytest.raises(ConfigError, match="FFN resident"):
        mlx_flash.load(store, backend="torch", ffn="stream", sparsity=0.4, progress=False)


class ReferenceOps:
    """Makes every thresholded product the masked reference (input masked, then the stored product)."""

    def thresholded(self, w, threshold, every_row):
        from mlx_flash.backends.thresholded import Thresholded

        return Thresholded(threshold, every_row, 0, 0, inner=w)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_the_kernel_skips_what_the_masked_reference_zeroes_and_counts_it(calibrated_q4, backend):
    from mlx_flash.choices import SparsityRows
    from mlx_flash.sparse.activation_sparsity import threshold_products
    from mlx_flash.stats import sparsity_stats

    ids = list(range(3, 40))
    with mlx_flash.load(calibrated_q4, backend=backend, ffn="resident", progress=False) as ref:
        found = load_thresholds(ref.store, ref.args.num_hidden_layers)
        threshold_products(ReferenceOps(), ref.weights, ref.ffn, found, 0.5, SparsityRows.ALL)
        want = ref.logits(ids)
        with mlx_flash.load(
            calibrated_q4, backend=backend, ffn="resident", sparsity=0.5, sparsity_rows="all", progress=False
        ) as e:
            assert all(p.kernel is not None for p in e.thresholded)
            np.testing.assert_allclose(e.logits(ids), want, rtol=1e-4, atol=1e-4)
    with mlx_flash.load(calibrated_q4, backend=backend, ffn="resident", sparsity=0.5, progress=False) as e:
        e.generate(TEXT[:60], max_tokens=8)
        st = sparsity_stats(e)
        steps = st["rows"] / len(e.thresholded)
        assert 6 <= steps <= 8  # each decode step's products, not the prompt's (dense) rows
        assert 0.3 < st["zeroed_share"] < 0.7 and st["read_bytes"] < st["dense_bytes"]


def test_the_sparse_ffn_reads_the_neurons_above_downs_thresholds(calibrated_q4):
    """ffn="sparse" with sparsity: the gate predictor selects by down's input thresholds (no trained
    predictor), and the attention products are thresholded as in the resident model."""
    from mlx_flash.options import FlashOptions

    def rows(sparsity, predictor):
        with mlx_flash.load(
            calibrated_q4,
            backend="torch",
            ffn="sparse",
            sparsity=sparsity,
            flash=FlashOptions(predictor=predictor),
            progress=False,
        ) as e:
            e.generate(TEXT[:60], max_tokens=8)
            st = e.ffn.stats()
            return st.rows_active / (st.decode_layer_steps * st.neurons), len(e.thresholded), e.args.num_hidden_layers

    dense, none, _ = rows(0.0, "dense")
    sparse, attention, layers = rows(0.5, "gate")
    assert dense == 1.0 and none == 0
    assert 0.2 < sparse < 0.8 and attention == 2 * layers  # q|k|v and o; the FFN is the selector's
    with pytest.raises(ConfigError, match="predictor 'gate'"):
        mlx_flash.load(calibrated_q4, backend="torch", ffn="sparse", sparsity=0.5, progress=False)


def test_the_greedy_allocation_rises_to_every_input_at_its_top_and_levels_follow_it(calibrated):
    from mlx_flash.calibrate.thresholds import TOP, greedy_allocation, role_params, search_wins

    store, found, _ = calibrated
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False) as e:
        points, checked = greedy_allocation(e, found, list(range(3, 60)), list(range(59, 2, -1)), progress=False)
        params = role_params(e.args)
    assert set(checked) == {"0.25", "0.4"} and all(set(c) == {"searched", "uniform"} for c in checked.values())
    assert search_wins({"0.4": {"searched": 1.0, "uniform": 2.0}})
    assert not search_wins({"0.4": {"searched": 2.0, "uniform": 1.0}})
    assert points[0] == [0.0, dict.fromkeys(ROLES, 0.0)] and all(
        v == pytest.approx(TOP) for v in points[-1][1].values()
    )
    for (a, la), (b, lb) in zip(points, points[1:]):  # one input moves a step at a time; the level rises
        assert b > a and sum(lb[r] != la[r] for r in ROLES) == 1
        assert b == pytest.approx(sum(lb[r] * params[r] for r in ROLES) / sum(params.values()), abs=1e-5)
    found.allocation = points
    mid = (points[3][0] + points[4][0]) / 2
    levels = found.role_levels(mid)
    for r in ROLES:
        assert levels[r] == pytest.approx((points[3][1][r] + points[4][1][r]) / 2)
    assert found.role_levels(0.93) == dict.fromkeys(ROLES, 0.93)  # past the search: every input at the level
    save_thresholds(mlx_flash.store.open_store(store), found)
    again = load_thresholds(mlx_flash.store.open_store(store), found.n_layers)
    assert again.allocation == points
