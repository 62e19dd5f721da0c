"""A Llama 3.x GGUF carries its "llama3" RoPE scaling as llama.cpp's converter writes it: a rope_freqs
tensor of per-pair divisors (no rope.scaling metadata). A tiny random Llama with Llama 3.1's scaling,
written as such a GGUF (q/k rows permuted the llama.cpp way), converts and matches transformers' run
of the HF original past the original context, on both backends."""

import math

import numpy as np
import pytest

import mlx_flash
import tiny_models
from mlx_flash.convert import convert

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
ORIGINAL, THETA = 32, 10000.0
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
}


def rope_factors(dim: int, base: float, s: dict) -> np.ndarray:
    """Each pair's divisor, as llama.cpp's converter derives them from a "llama3" scaling (float32)."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, low, high, factor = (
        s["original_max_position_embeddings"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["factor"],
    )
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its interleaved RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, hf, default_gguf) -> None:
    from mlx_flash.calibrate.synthetic_gguf import tokenizer_fields

    c = hf.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
    }.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32("llama.rope.freq_base", THETA)
    for key, (value, vtype, sub) in tokenizer_fields(default_gguf).items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    head_dim = c.hidden_size // c.num_attention_heads
    w.add_tensor("rope_freqs.weight", rope_factors(head_dim, THETA, LLAMA3))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for i in range(c.num_hidden_layers):
        for hf_name, g in names.items():
            a = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g == "attn_q":
                a = permute(a, c.num_attention_heads)
            elif g == "attn_k":
                a = permute(a, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g}.weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# the scaled frequencies come from models/rope.py for both backends; each backend's rope against the
# reference: tests/backends/test_ops.py
@pytest.mark.parametrize("backend", [pytest.param("mlx", marks=pytest.mark.full), "torch"])
def test_rope_freqs_tensor_matches_the_llama3_scaling(tmp_path, default_gguf, backend):
    hf = tiny_models.build(
        "llama",
        str(tmp_path / "hf"),
        rope_scaling=dict(LLAMA3),
        vocab_size=49152,
        max_position_embeddings=256,
        rope_theta=THETA,
    )
    write_llama_gguf(tmp_path / "llama3.gguf", hf, default_gguf)
    store = convert(str(tmp_path / "llama3.gguf"), str(tmp_path / "store"), progress=False)
    ids = tiny_models.random_ids(160, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    with mlx_flash.load(store, backend=backend, progress=False) as e:
        assert e.store.config["rope_scaling"]["rope_type"] == "factors"
        got = e.logits(ids)
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
