"""Row-column bundle layout: bytes of neuron i = gate row i | up row i | down column i; for a source
quantized along d_ff, bundles of one quantization group of neurons holding the source's bytes."""

import numpy as np
import pytest

from mlx_flash.store import open_store
from mlx_flash.store.bundles import NUMPY_DTYPES, pack_layer, plan_fields, unpack_rows
from mlx_flash.store.manifest import ALIGNMENT


def test_pack_unpack_roundtrip():
    rng = np.random.default_rng(0)
    parts = [
        ("gate.weight", rng.integers(0, 2**32, (10, 7), dtype=np.uint32), "uint32"),
        ("gate.scales", rng.standard_normal((10, 3)).astype(np.float16), "float16"),  # 6 bytes: pads
        ("up.bias", rng.standard_normal((10, 1)).astype(np.float32), "float32"),
    ]
    fields, nbytes = plan_fields(parts)
    assert [f.offset % 4 for f in fields] == [0, 0, 0] and nbytes % 4 == 0
    rows = pack_layer(fields, nbytes, {n: a for n, a, _ in parts})
    out = unpack_rows(fields, rows[[3, 7]])
    for n, a, _ in parts:
        assert np.array_equal(out[n], a[[3, 7]])


def read_bundle(store, layer, neuron):
    m = store.manifest.ffn
    with open(store.file_path(m.file), "rb") as fh:
        fh.seek(m.layer_offsets[layer] + neuron * m.bundle_bytes)
        return np.frombuffer(fh.read(m.bundle_bytes), dtype=np.uint8)


def test_f16_bundles_hold_gate_up_rows_and_down_column(tiny_store):
    """Check the file bytes against the source matrices directly."""
    torch = pytest.importorskip("torch")
    store_dir, hf = tiny_store("llama", precision="f16")
    store = open_store(store_dir)
    m = store.manifest.ffn
    assert [f.name for f in m.fields] == ["gate.weight", "up.weight", "down.weight"]
    assert all(off % ALIGNMENT == 0 for off in m.layer_offsets)
    layer, D = 1, m.d_model
    mlp = hf.model.layers[layer].mlp
    for neuron in (0, 5, m.n_neurons - 1):
        b = read_bundle(store, layer, neuron).view(np.float16)
        with torch.no_grad():
            assert np.array_equal(b[:D], mlp.gate_proj.weight[neuron].half().numpy())
            assert np.array_equal(b[D : 2 * D], mlp.up_proj.weight[neuron].half().numpy())
            assert np.array_equal(b[2 * D : 3 * D], mlp.down_proj.weight[:, neuron].half().numpy())


def test_opt_bundle_carries_fc1_bias(tiny_store):
    torch = pytest.importorskip("torch")
    store_dir, hf = tiny_store("opt", precision="f16")
    store = open_store(store_dir)
    names = [f.name for f in store.manifest.ffn.fields]
    assert names == ["up.weight", "up.bias", "down.weight"]
    assert "model.decoder.layers.0.fc2.bias" in store.manifest.tensors  # per-d_model bias stays resident
    fc1 = hf.model.decoder.layers[0].fc1
    f = {x.name: x for x in store.manifest.ffn.fields}["up.bias"]
    b = read_bundle(store, 0, 9)[f.offset : f.offset + f.nbytes].view(NUMPY_DTYPES[f.dtype])
    with torch.no_grad():
        assert b[0] == fc1.bias[9].to(getattr(torch, f.dtype)).item()


def test_quantized_bundles_keep_source_rows(store_dir, default_gguf):
    """Default store: bundles of 32 neurons whose gate rows, up rows and down block are the GGUF's
    Q4_1 bytes untouched (read back through the one decoding the compute uses)."""
    import mlx.core as mx

    from mlx_flash.store.ffn_reader import FFNReader
    from mlx_flash.store.reader_pool import ReaderPool
    from mlx_flash.weights import neuron_arrays

    store = open_store(store_dir)
    m = store.manifest.ffn
    assert m.block == 32 and all(m.quant[r].bits == 4 for r in ("gate", "up", "down"))
    src = mx.load(default_gguf)
    with ReaderPool(threads=1, mode="buffered") as pool:
        arrays, transposed = neuron_arrays(m, FFNReader(pool, store.file_path(m.file), m).read_layer(3))
    assert not transposed
    for role, gg in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
        for part in ("weight", "scales", "biases"):
            expect = np.array(src[f"blk.3.{gg}.{part}"])
            assert arrays[f"{role}.{part}"][0].tobytes() == expect.tobytes(), (role, part)
