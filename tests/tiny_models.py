"""Tiny random-init HF checkpoints built in the tests from each family's real config shape (no hub):
a directory with config.json, model.safetensors and a small word-level tokenizer."""

from __future__ import annotations

import json
import os

import numpy as np

VOCAB = 96
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def write_tokenizer(out_dir: str, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
            },
            fh,
        )


def hf_config(family: str, **over):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "opt":
        cfg = tf.OPTConfig(**{**common, "ffn_dim": 128, "word_embed_proj_dim": 64, **over})
    elif family in MOE_FAMILIES:
        kw = dict(
            intermediate_size=32,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            num_experts_per_tok=2,
        )
        if family == "mixtral":
            cfg = tf.MixtralConfig(**{**common, **kw, "num_local_experts": 4, **over})
        else:
            kw.update(num_experts=4, moe_intermediate_size=32)
            if family == "qwen2_moe":
                kw.update(shared_expert_intermediate_size=48, intermediate_size=96)
            if family == "qwen3_moe":
                kw.update(head_dim=16, norm_topk_prob=True)
            cls = {"qwen2_moe": tf.Qwen2MoeConfig, "qwen3_moe": tf.Qwen3MoeConfig, "olmoe": tf.OlmoeConfig}[family]
            cfg = cls(**{**common, **kw, **over})
    elif family == "gemma3_text":  # six layers: five sliding (a window of 8) and one full
        kw = dict(
            intermediate_size=96,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            rms_norm_eps=1e-6,
        )
        cfg = tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 6, **kw, **over})
    else:
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config}[
            family
        ]
        kw = dict(intermediate_size=96, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False)
        if family == "qwen3":
            kw["head_dim"] = 16
        cfg = cls(**{**common, **kw, **over})
    return cfg


def build(family: str, out_dir: str, seed: int = 0, dtype: str = "float32", **over):
    """Save a random tiny model of `family` to out_dir; returns the HF model (eval mode, float32)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hf_config(family, **over)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # default init is tiny; widen it so logits are not all near zero
        for p in model.parameters():
            if p.dim() >= 1:
                p.add_(torch.randn_like(p) * 0.05)
    os.makedirs(out_dir, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    return model.float()


def quantize_dir(hf_dir, out_dir, bits=4, group=32, overrides=None):
    """Quantize every 2-D linear the way mlx-lm does into an mlx-community style directory; returns
    the dequantized tensors (the exact values the quantized checkpoint stands for)."""
    import mlx.core as mx

    overrides = overrides or {}
    tensors = mx.load(os.path.join(hf_dir, "model.safetensors"))
    out, exact = {}, {}
    for name, w in tensors.items():
        base = name[: -len(".weight")]
        if name.endswith(".weight") and w.ndim == 2:
            b = overrides.get(base, bits)
            q, s, z = mx.quantize(w.astype(mx.float16), group_size=group, bits=b)
            out.update({f"{base}.weight": q, f"{base}.scales": s, f"{base}.biases": z})
            # in float32, as the engine computes q * scale + bias (float16 arithmetic would round it)
            exact[name] = mx.dequantize(q, s.astype(mx.float32), z.astype(mx.float32), group_size=group, bits=b)
        else:
            out[name] = w
            exact[name] = w
    os.makedirs(out_dir, exist_ok=True)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), out)
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    cfg["quantization"] = {
        "group_size": group,
        "bits": bits,
        **{k: {"group_size": group, "bits": v} for k, v in overrides.items()},
    }
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"))
    write_tokenizer(out_dir)
    return exact


def edit_config(hf_dir, **changes) -> None:
    """Rewrite fields of a saved model's config.json (to build a deliberately broken checkpoint)."""
    path = os.path.join(hf_dir, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    cfg.update(changes)
    with open(path, "w") as fh:
        json.dump(cfg, fh)


def random_ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def edit_manifest(store_dir: str, fn) -> None:
    """Apply fn to a store's parsed manifest and write it back sealed again: a hand edit that also
    fixes the seal, to reach the checks behind it (an edit that does not is refused by the seal)."""
    import json
    import os

    from mlx_flash.store.manifest import SEAL, seal_of

    path = os.path.join(store_dir, "manifest.json")
    with open(path) as fh:
        m = json.load(fh)
    m.pop(SEAL, None)
    fn(m)
    if isinstance(m, dict):
        m[SEAL] = seal_of(m)
    with open(path, "w") as fh:
        json.dump(m, fh)
