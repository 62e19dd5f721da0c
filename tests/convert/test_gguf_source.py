"""GGUF tensors read by offset, block by block: the same arrays `mx.load` gives for the whole file,
a stack of experts read one expert at a time as gguf dequantizes it, and a clear error for what is
not supported."""

import numpy as np
import pytest

from mlx_flash.convert.gguf_blocks import BLOCK_TYPES
from mlx_flash.convert.gguf_source import _gguf_name, read_gguf
from mlx_flash.convert.tensor_source import GGUFTensors
from mlx_flash.errors import ModelFileError, UnsupportedModelError

gguf = pytest.importorskip("gguf")
mx = pytest.importorskip("mlx.core")


def _write(path, tensors: dict, arch: str = "llama", meta: dict | None = None):
    """tensors: GGUF name -> (float32 array, GGMLQuantizationType); meta: `{arch}.` key -> uint32."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (meta or {}).items():
        w.add_uint32(f"{arch}.{key}", value)
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
    tensors = {
        f"blk.0.{n}.weight": (rng.standard_normal((r, c)).astype(np.float32) * s, q)
        for n, r, c, s, q in [
            ("q40", 48, 96, 0.1, Q.Q4_0),
            ("q41", 40, 64, 3.0, Q.Q4_1),
            ("q80", 24, 128, 0.02, Q.Q8_0),
            ("f16", 8, 32, 1.0, Q.F16),
            ("f32", 1, 64, 1.0, Q.F32),
        ]
    }
    path = tmp_path / "mixed.gguf"
    _write(path, tensors)
    _assert_same_as_mx_load(path)
    assert {b.name for b in BLOCK_TYPES.values()} == {"Q4_0", "Q4_1", "Q8_0"}


@pytest.mark.slow
def test_default_model_reads_as_mx_load(default_gguf):
    _assert_same_as_mx_load(default_gguf)


def test_unsupported_type_is_named(tmp_path):
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    raw = np.random.default_rng(1).integers(0, 256, (4, 84), dtype=np.uint8)  # Q2_K: 84 bytes per 256 weights
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up\.weight has GGML type Q2_K; supported: .*Q4_K"):
        GGUFTensors(str(path), _reader(path), _gguf_name)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_kept_block_types_are_the_files_bytes(tmp_path, kind):
    from mlx_flash.convert.gguf_quantize import quantize_k

    rng = np.random.default_rng(2)
    w = rng.standard_normal((6, 512)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype) if kind in ("Q5_0", "Q5_1") else quantize_k(w, kind)
    path = tmp_path / "k.gguf"
    g = gguf.GGUFWriter(str(path), "llama")
    g.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    src = GGUFTensors(str(path), _reader(path), _gguf_name)
    base = "model.layers.0.mlp.up_proj"
    assert src.quant_specs()[base].kind == kind
    assert src.spec(base + ".weight") == ([6, raw.shape[1]], "uint8")
    assert np.array_equal(src.take_numpy(base + ".weight"), raw)


def test_take_hands_over_each_part_once(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "one.gguf"
    _write(
        path, {"blk.0.ffn_up.weight": (rng.standard_normal((8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)}
    )
    src = GGUFTensors(str(path), _reader(path), _gguf_name)
    base = "model.layers.0.mlp.up_proj"
    assert {b: (q.bits, q.kind) for b, q in src.quant_specs().items()} == {base: (4, None)}
    assert src.spec(base + ".scales") == ([8, 2], "float16")
    first = src.take_numpy(base + ".scales")  # decodes the triple, keeps the other two parts
    assert set(src._pending) == {base + ".weight", base + ".biases"}
    src.take_numpy(base + ".weight")
    src.take_numpy(base + ".biases")
    assert not src._pending, "parts handed over are still held"
    again = src.take_numpy(base + ".scales")  # a second take reads the file again
    assert np.array_equal(first, again)


def _affine(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """An affine triple as float32 weights: code * scale + bias, codes packed little-endian."""
    b = codes.view(np.uint8)
    q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], -1) if bits == 4 else b
    q = q.reshape(*scales.shape, -1).astype(np.float32)
    return (q * scales[..., None].astype(np.float32) + biases[..., None].astype(np.float32)).reshape(q.shape[0], -1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_each_expert_of_a_stack_is_read_alone_as_gguf_dequantizes_it(tmp_path, qtype):
    rng = np.random.default_rng(3)
    E, F, D = 3, 8, 64
    q = gguf.GGMLQuantizationType[qtype]
    path = tmp_path / "exps.gguf"
    _write(path, {"blk.0.ffn_down_exps.weight": (rng.standard_normal((E, D, F * 4)).astype(np.float32) * 0.1, q)})
    t = _reader(path).tensors[0]
    want = gguf.quants.dequantize(t.data, q)  # [E, D, 4F], experts outermost
    src = GGUFTensors(str(path), _reader(path), _gguf_name)
    assert src.stacks() == {"blk.0.ffn_down_exps.weight": E}
    reads = []
    real_read = src._read
    src._read = lambda off, n, name: reads.append((off, n)) or real_read(off, n, name)
    bits = BLOCK_TYPES[int(q)].bits
    for e in range(E):
        base = f"model.layers.0.mlp.experts.{e}.down_proj"
        assert src.quant_specs()[base].bits == bits
        assert src.spec(base + ".weight") == ([D, 4 * F * bits // 32], "uint32")
        triple = [src.take_numpy(f"{base}.{p}") for p in ("weight", "scales", "biases")]
        assert np.array_equal(_affine(*triple, bits), want[e]), f"expert {e}"
    per = int(t.n_bytes) // E
    assert reads == [(int(t.data_offset) + e * per, per) for e in range(E)]  # one expert's bytes per read


def _moe_meta(experts: int) -> dict:
    return {
        "block_count": 1,
        "embedding_length": 64,
        "attention.head_count": 2,
        "expert_count": experts,
        "expert_used_count": 1,
        "expert_feed_forward_length": 32,
    }


def test_other_moe_architectures_and_bad_stacks_are_refused(tmp_path):
    rng = np.random.default_rng(4)
    stack = {
        "blk.0.ffn_up_exps.weight": (
            rng.standard_normal((2, 32, 64)).astype(np.float32),
            gguf.GGMLQuantizationType.Q8_0,
        )
    }
    mixtral = tmp_path / "mixtral.gguf"
    _write(mixtral, stack, "llama", _moe_meta(2))
    with pytest.raises(
        UnsupportedModelError,
        match="mixture-of-experts GGUF of architecture 'llama' is not supported "
        r"\(supported: qwen3moe\)",
    ):
        read_gguf(str(mixtral))
    qwen2moe = tmp_path / "qwen2moe.gguf"
    _write(qwen2moe, stack, "qwen2moe")  # no expert_count: the stacks alone say it is a MoE
    with pytest.raises(UnsupportedModelError, match="architecture 'qwen2moe'"):
        read_gguf(str(qwen2moe))
    wrong = tmp_path / "wrong.gguf"
    _write(wrong, stack, "qwen3moe", _moe_meta(3))
    with pytest.raises(
        ModelFileError, match=r"blk\.0\.ffn_up_exps\.weight holds 2 experts, but qwen3moe\.expert_count is 3"
    ):
        read_gguf(str(wrong))
    lacking = tmp_path / "lacking.gguf"
    _write(lacking, stack, "qwen3moe", {k: v for k, v in _moe_meta(2).items() if k != "expert_used_count"})
    with pytest.raises(ModelFileError, match=r"lacks qwen3moe\.expert_used_count$"):
        read_gguf(str(lacking))
    flat = tmp_path / "flat.gguf"  # a 2-D tensor under an expert-stack name
    _write(
        flat,
        {
            "blk.0.ffn_up_exps.weight": (
                rng.standard_normal((32, 64)).astype(np.float32),
                gguf.GGMLQuantizationType.Q8_0,
            )
        },
        "qwen3moe",
        _moe_meta(2),
    )
    with pytest.raises(ModelFileError, match="is not a stack of experts"):
        read_gguf(str(flat))
