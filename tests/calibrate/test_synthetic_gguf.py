"""Synthetic GGUF checkpoints: a small made-up shape parses with gguf's reader with llama.cpp's
tensor names, types and shapes, carries the default model's tokenizer metadata, holds small finite
centred weights in every quantization, converts into a store whose logits are finite, and bad
input is refused in one line."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from mlx_flash.calibrate import synthetic, synthetic_gguf
from mlx_flash.errors import ConfigError

VOCAB = 49152  # the default model's tokenizer


@pytest.fixture
def small_shape(monkeypatch):
    shape = dict(synthetic.SHAPES["llama-2-7b"], hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    monkeypatch.setitem(synthetic.SHAPES, "small", shape)
    return "small"


def expected_tensors(quant: str, layers: int) -> dict:
    q, f32 = GGMLQuantizationType[quant], GGMLQuantizationType.F32
    want = {"token_embd.weight": (q, [64, VOCAB]), "output_norm.weight": (f32, [64]),
            "output.weight": (q, [64, VOCAB])}
    for i in range(layers):  # gguf shapes are [in, out] (ggml's ne order)
        want.update({f"blk.{i}.attn_norm.weight": (f32, [64]), f"blk.{i}.ffn_norm.weight": (f32, [64]),
                     f"blk.{i}.attn_q.weight": (q, [64, 64]), f"blk.{i}.attn_k.weight": (q, [64, 32]),
                     f"blk.{i}.attn_v.weight": (q, [64, 32]), f"blk.{i}.attn_output.weight": (q, [64, 64]),
                     f"blk.{i}.ffn_gate.weight": (q, [64, 96]), f"blk.{i}.ffn_up.weight": (q, [64, 96]),
                     f"blk.{i}.ffn_down.weight": (q, [96, 64])})
    return want


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    """The default model's tokenizer fields, read once (reading 98k strings takes seconds)."""
    return synthetic_gguf.tokenizer_fields(default_gguf)


@pytest.mark.parametrize("quant", ["Q4_1", "Q4_0", "Q8_0"])
def test_file_parses_with_llama_names_types_tokenizer_and_small_weights(tmp_path, small_shape, tokenizer, quant):
    path = synthetic_gguf.write_synthetic_gguf(str(tmp_path / "s.gguf"), small_shape, quant, layers=2,
                                               progress=False, tokenizer=tokenizer)
    r = GGUFReader(path)
    got = {t.name: (t.tensor_type, [int(n) for n in t.shape]) for t in r.tensors}
    assert got == expected_tensors(quant, 2)
    meta = {k: f.contents() for k, f in r.fields.items()}
    assert meta["general.architecture"] == "llama" and "synthetic" in meta["general.name"]
    assert meta["general.file_type"] == {"Q4_1": 3, "Q4_0": 2, "Q8_0": 7}[quant]
    assert {k: meta[f"llama.{k}"] for k in ("block_count", "embedding_length", "feed_forward_length",
                                             "attention.head_count", "attention.head_count_kv", "vocab_size",
                                             "rope.dimension_count", "context_length")} == {
        "block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
        "attention.head_count_kv": 2, "vocab_size": VOCAB, "rope.dimension_count": 16, "context_length": 4096}
    ours = {k: (v.contents(), v.types[0], v.types[-1] if len(v.types) > 1 else None)
            for k, v in r.fields.items() if k.startswith("tokenizer.")}
    assert ours == tokenizer  # every tokenizer.* field of the default model, same values and types
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        if t.tensor_type == GGMLQuantizationType.F32:
            assert (w == 1).all(), t.name  # norms of ones
        else:
            assert np.abs(w).max() <= 0.0251, t.name
            assert 0.008 < w.std() < 0.014 and abs(w.mean()) < 5e-4, (t.name, w.std(), w.mean())


def test_converts_into_a_store_with_finite_logits(tmp_path, small_shape, tokenizer):
    import mlx_flash
    from mlx_flash.convert import convert
    from mlx_flash.store import open_store

    path = synthetic_gguf.write_synthetic_gguf(str(tmp_path / "s.gguf"), small_shape, seed=1, progress=False,
                                               tokenizer=tokenizer)
    store = convert(path, str(tmp_path / "store"), progress=False)
    cfg = open_store(store).manifest.config
    assert (cfg["num_hidden_layers"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (3, VOCAB, False)
    with mlx_flash.load(store, progress=False) as engine:
        logits = engine.logits(engine.tokenizer.encode("The capital of France is"))
    assert logits.shape[-1] == VOCAB and np.isfinite(logits).all() and 0.05 < logits.std() < 10


def test_bad_input_is_refused_in_one_line(tmp_path, small_shape, tokenizer, monkeypatch):
    out = str(tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="'Q3_K' is unknown"):
        synthetic_gguf.write_synthetic_gguf(out, small_shape, "Q3_K", progress=False)
    with pytest.raises(ConfigError, match="'gpt-9' is unknown"):
        synthetic_gguf.write_synthetic_gguf(out, "gpt-9", progress=False)
    with pytest.raises(ConfigError, match="mixture of experts"):
        synthetic_gguf.write_synthetic_gguf(out, "mixtral-8x7b", progress=False)
    monkeypatch.setattr(synthetic_gguf.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(ConfigError, match="GB free"):
        synthetic_gguf.write_synthetic_gguf(out, small_shape, progress=False, tokenizer=tokenizer)
    assert not list(tmp_path.iterdir())  # nothing written, not even a partial file
