"""The default (`source`) conversion of a checkpoint whose down projection is quantized along d_ff
keeps the source's bytes: bundles of one quantization group of neurons (gate rows, up rows and the
down matrix's slice of those neurons, exactly as stored). Every FFN mode computes on them exactly,
and a sparse selection zeroes exactly the unselected neurons of the blocks it reads."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_flash
import tiny_models
from mlx_flash.convert import convert
from mlx_flash.sparse.predictor import LayerPredictor, Predictors
from mlx_flash.store import open_store
from mlx_flash.store.bundles import unpack_rows
from mlx_flash.store.ffn_reader import FFNReader
from mlx_flash.store.reader_pool import ReaderPool
from mlx_flash.weights import neuron_arrays

pytest.importorskip("torch")
F, GROUP = 128, 32  # four blocks of 32 neurons


def quantized_source(tmp_path, bits=4):
    tiny_models.build("llama", str(tmp_path / "hf"), intermediate_size=F)
    tiny_models.quantize_dir(str(tmp_path / "hf"), str(tmp_path / f"q{bits}"), bits=bits, group=GROUP)
    return str(tmp_path / f"q{bits}")


@pytest.mark.parametrize("bits", [4, 8])
def test_bundles_hold_the_source_bytes(tmp_path, bits):
    src = quantized_source(tmp_path, bits)
    store = open_store(convert(src, str(tmp_path / "store"), progress=False))
    lay = store.manifest.ffn
    assert (lay.block, lay.n_rows, lay.precision) == (GROUP, F // GROUP, "source")
    tensors = mx.load(src + "/model.safetensors")
    with ReaderPool(threads=1, mode="buffered") as pool:
        for layer in range(len(lay.layer_offsets)):
            rows = FFNReader(pool, store.file_path(lay.file), lay).read_layer(layer)
            arrays, transposed = neuron_arrays(lay, rows)
            assert not transposed  # down in the linear's own orientation [D, F]
            for role, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                for part in ("weight", "scales", "biases"):
                    want = np.array(tensors[f"model.layers.{layer}.mlp.{name}.{part}"])
                    got = arrays[f"{role}.{part}"][0]
                    assert got.shape == want.shape and got.tobytes() == want.tobytes(), (layer, role, part)
            # one bundle alone holds its block: the down slice of neurons 32..63 is bundle 1's
            one = unpack_rows(lay.fields, rows[1:2])["down.scales"][0, :, 0]
            want = np.array(tensors[f"model.layers.{layer}.mlp.down_proj.scales"])[:, 1]
            assert one.tobytes() == want.tobytes()


def test_source_neuron_is_one_neuron_per_bundle(tmp_path):
    store = open_store(
        convert(quantized_source(tmp_path), str(tmp_path / "store"), precision="source-neuron", progress=False)
    )
    assert (store.manifest.ffn.block, store.manifest.ffn.n_rows) == (1, F)


def run(engine, ids, prompt=12):
    full = engine.logits(ids)
    caches = engine.new_caches()
    engine.prefill(ids[:prompt], caches)
    return full, np.stack([engine.forward([t], caches)[-1] for t in ids[prompt:]])


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_every_mode_equals_resident(tmp_path, backend):
    store = convert(quantized_source(tmp_path), str(tmp_path / "store"), progress=False)
    ids = tiny_models.random_ids(20)
    with mlx_flash.load(store, backend=backend, progress=False) as e:
        want = run(e, ids)
    configs = [dict(ffn="stream")] + [
        dict(
            ffn="sparse",
            weights_budget=budget,
            flash=mlx_flash.FlashOptions(mode=mode, predictor="dense"),
            io=mlx_flash.IOOptions(mode="buffered"),
        )
        # 115-130%: one to three of four blocks per layer fit (hybrid keeps them beside its two layer
        # buffers, the caches overflow); 200%: all fit
        for mode, budget in (
            ("naive", "200%"),
            ("hybrid", "130%"),
            ("predictor", "200%"),
            ("window", "120%"),
            ("all", "200%"),
            ("all", "120%"),
            ("all", "115%"),
        )
    ]
    # the reference path (active rows as framework weights) beside the CPU sparse kernel
    configs.append(
        dict(
            ffn="sparse",
            weights_budget="200%",
            io=mlx_flash.IOOptions(mode="buffered"),
            flash=mlx_flash.FlashOptions(mode="all", predictor="dense", kernel="reference"),
        )
    )
    for kw in configs:
        with mlx_flash.load(store, backend=backend, progress=False, **kw) as e:
            got = run(e, ids)
            if kw["ffn"] == "sparse" and kw["weights_budget"] != "200%":
                assert 0 < e.ffn.plan.capacity < 4
            if kw["ffn"] == "sparse" and kw["flash"].mode.needs_predictor:
                assert e.ffn.stats().sparse_kernel == kw["flash"].kernel.value.replace("auto", "cpu")
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), kw


def save_selection(store_dir, active: np.ndarray):
    """Predictors that select exactly `active` [F] (same set every token and layer)."""
    m = open_store(store_dir).manifest.ffn
    n = len(m.layer_offsets)
    b = np.where(active, 10.0, -10.0).astype(np.float32)
    Predictors(
        [LayerPredictor(np.zeros((m.d_model, 2), np.float32), np.zeros((2, F), np.float32), b, 0.0) for _ in range(n)],
        0.5,
        [0.0] * n,
    ).save(store_dir)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_partial_selection_zeroes_exactly_the_unselected_neurons(tmp_path, backend):
    """Reference: the same model with the unselected neurons' up rows set to zero (codes, scale and
    bias 0 dequantize to exactly 0, so those neurons add nothing) computed densely."""
    src = quantized_source(tmp_path)
    active = np.zeros(F, bool)
    active[[3, 40, 41, 70]] = True  # three of four blocks touched, most of their neurons unselected
    store = convert(src, str(tmp_path / "store"), progress=False)
    save_selection(store, active)
    tensors = dict(mx.load(src + "/model.safetensors"))
    for layer in range(2):
        for part in ("weight", "scales", "biases"):
            name = f"model.layers.{layer}.mlp.up_proj.{part}"
            a = np.array(tensors[name])
            a[~active] = 0
            tensors[name] = mx.array(a)
    mx.save_safetensors(src + "/model.safetensors", tensors)
    ref_store = convert(src, str(tmp_path / "ref"), progress=False)
    ids = tiny_models.random_ids(20)
    with mlx_flash.load(ref_store, backend=backend, progress=False) as e:
        want = run(e, ids)
    for mode in ("predictor", "all"):
        with mlx_flash.load(
            store,
            backend=backend,
            ffn="sparse",
            weights_budget="200%",
            progress=False,
            flash=mlx_flash.FlashOptions(mode=mode),
            io=mlx_flash.IOOptions(mode="buffered"),
        ) as e:
            got = run(e, ids)
            assert e.ffn.stats().rows_loaded > 0
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-4)
        np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("down_only", [False, True])
def test_gate_predictor_on_blocks(tmp_path, down_only):
    """The gate predictor at threshold 0 selects every neuron with a nonzero activation: exact when
    the FFN recomputes from the streamed bundles; down-only (activations from the predictor's own
    copy, the down block alone read per bundle) stays close and reads down bytes only."""
    import json

    store = convert(quantized_source(tmp_path), str(tmp_path / "store"), progress=False)
    save_selection(store, np.ones(F, bool))
    meta = json.load(open(f"{store}/predictors.json"))
    meta["magnitude_thresholds"] = [0.0] * len(meta["magnitude_thresholds"])
    json.dump(meta, open(f"{store}/predictors.json", "w"))
    ids = tiny_models.random_ids(20)
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        want = run(e, ids)
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="200%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="all", predictor="gate", down_only=down_only),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        got = run(e, ids)
        lay = e.ffn.layout
        down_bytes = sum(f.nbytes for f in lay.fields if f.name.startswith("down."))
        assert e.ffn.caches[0].row_bytes == (down_bytes if down_only else lay.bundle_bytes)
    if down_only:
        assert np.abs(got[0] - want[0]).max() < 0.1 * np.abs(want[0]).max()
    else:
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_statistical_predictor_draws_its_share_of_blocks(tmp_path, share):
    """The labelled statistical activity model (synthetic checkpoints) marks whole read units: each
    decode step of each layer has round(share x units) blocks active, all their neurons with them."""
    store = convert(quantized_source(tmp_path), str(tmp_path / "store"), progress=False)
    flash = mlx_flash.FlashOptions(predictor="statistical", statistical_active=share)
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="200%",
        flash=flash,
        progress=False,
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        run(e, tiny_models.random_ids(16))
        s = e.ffn.stats()
    assert s.decode_layer_steps > 0
    assert s.rows_active == s.decode_layer_steps * round(share * F // GROUP) * GROUP


def test_statistical_share_is_checked():
    with pytest.raises(mlx_flash.ConfigError, match="statistical active share must be in"):
        mlx_flash.FlashOptions(predictor="statistical", statistical_active=1.5)
