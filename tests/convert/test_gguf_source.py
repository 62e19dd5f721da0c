"""GGUF tensors read by offset, block by block: the same arrays `mx.load` gives for the whole file,
and a clear error for what is not supported."""

import numpy as np
import pytest

from mlx_flash.convert.gguf_blocks import BLOCK_TYPES
from mlx_flash.convert.sources import _gguf_name
from mlx_flash.convert.tensor_source import GGUFTensors
from mlx_flash.errors import UnsupportedModelError

gguf = pytest.importorskip("gguf")
mx = pytest.importorskip("mlx.core")


def _write(path, tensors: dict):
    """tensors: GGUF name -> (float32 array, GGMLQuantizationType)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (a, qtype) in tensors.items():
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, a.astype(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reader(path):
    return gguf.GGUFReader(str(path))


def _assert_same_as_mx_load(path):
    ref = mx.load(str(path))
    src = GGUFTensors(str(path), _reader(path), lambda n: n)
    assert sorted(src.names()) == sorted(ref)
    for name in src.names():
        shape, dtype = src.spec(name)
        got = src.take_numpy(name)
        want = np.array(ref[name])
        assert list(got.shape) == shape == list(want.shape), name
        assert got.dtype == want.dtype, name
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{name}: bytes differ from mx.load's"


def test_block_types_decode_as_mx_load(tmp_path):
    rng = np.random.default_rng(0)
    Q = gguf.GGMLQuantizationType
    tensors = {f"blk.0.{n}.weight": (rng.standard_normal((r, c)).astype(np.float32) * s, q)
               for n, r, c, s, q in [("q40", 48, 96, 0.1, Q.Q4_0), ("q41", 40, 64, 3.0, Q.Q4_1),
                                     ("q80", 24, 128, 0.02, Q.Q8_0), ("f16", 8, 32, 1.0, Q.F16),
                                     ("f32", 1, 64, 1.0, Q.F32)]}
    path = tmp_path / "mixed.gguf"
    _write(path, tensors)
    _assert_same_as_mx_load(path)
    assert {b.name for b in BLOCK_TYPES.values()} == {"Q4_0", "Q4_1", "Q8_0"}


@pytest.mark.slow
def test_default_model_reads_as_mx_load(default_gguf):
    _assert_same_as_mx_load(default_gguf)


def test_unsupported_type_is_named(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "k.gguf"
    _write(path, {"blk.0.ffn_up.weight": (rng.standard_normal((4, 256)).astype(np.float32),
                                          gguf.GGMLQuantizationType.Q5_0)})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up\.weight has GGML type Q5_0"):
        GGUFTensors(str(path), _reader(path), _gguf_name)


def test_take_hands_over_each_part_once(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "one.gguf"
    _write(path, {"blk.0.ffn_up.weight": (rng.standard_normal((8, 64)).astype(np.float32),
                                          gguf.GGMLQuantizationType.Q4_1)})
    src = GGUFTensors(str(path), _reader(path), _gguf_name)
    base = "model.layers.0.mlp.up_proj"
    assert src.quant_bits() == {base: 4}
    assert src.spec(base + ".scales") == ([8, 2], "float16")
    first = src.take_numpy(base + ".scales")  # decodes the triple, keeps the other two parts
    assert set(src._pending) == {base + ".weight", base + ".biases"}
    src.take_numpy(base + ".weight")
    src.take_numpy(base + ".biases")
    assert not src._pending, "parts handed over are still held"
    again = src.take_numpy(base + ".scales")  # a second take reads the file again
    assert np.array_equal(first, again)
