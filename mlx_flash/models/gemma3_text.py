"""Gemma 3 (text): the llama layout with Gemma's differences, written against the backend op set.

- RMSNorm scales by (1 + w) (the stored w is what the checkpoint holds; 1 + w is formed at build);
  each block norms its attention and FFN outputs too (post_attention / post_feedforward norms).
- Queries and keys get a per-head RMSNorm before RoPE; attention scales by
  query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
- Layers are "sliding_attention" (a window of `window` tokens, RoPE base rope_local_theta) or
  "full_attention" (the whole context, RoPE base rope_theta and its scaling): five sliding to one
  full in the released models. The KV cache holds every token; a sliding layer's mask hides the
  keys older than its window.
- The FFN is GeGLU: down(gelu_tanh(gate x) * up x).
- Embeddings are scaled by sqrt(hidden_size); the head is the embedding (tied).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import UnsupportedModelError
from ..ffn_source import FFNWeights, GateActivation, LayerSource
from .cache import RowsMask, WindowMask
from .common import ArgsFromDict, GGUFLayout, gated_hidden, gated_mlp, linear
from .rope import rope_frequencies

LAYER = "model.layers.{}."
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelArgs(ArgsFromDict):
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    layer_types: list = field(default_factory=list)
    window: int = 512  # keys a sliding layer attends to, its own token included
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # full-attention layers
    rope_local_theta: float = 10_000.0  # sliding layers
    rope_scale: float = 1.0  # full-attention layers' linear scaling
    rope_scaling: dict | None = None  # full-attention layers' llama3 / yarn scaling
    query_pre_attn_scalar: float = 256.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    rope_traditional: bool = False
    sliding_window: int | None = None  # (attention is windowed per layer here, so no context bound from it)
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None


def normalize_config(hf: dict, where: str) -> dict:
    hf = hf.get("text_config") or hf  # a multimodal Gemma 3 config holds the text model's inside
    try:
        n = int(hf["num_hidden_layers"])
        types = list(
            hf.get("layer_types")
            or [FULL if (i + 1) % int(hf.get("sliding_window_pattern", 6)) == 0 else SLIDING for i in range(n)]
        )
        params = hf.get("rope_parameters") or {}
        full = params.get(FULL) or {"rope_theta": hf.get("rope_theta", 1_000_000.0), **(hf.get("rope_scaling") or {})}
        local = params.get(SLIDING) or {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
        cfg = {
            "model_type": "gemma3_text",
            "hidden_size": int(hf["hidden_size"]),
            "intermediate_size": int(hf["intermediate_size"]),
            "num_hidden_layers": n,
            "num_attention_heads": int(hf["num_attention_heads"]),
            "num_key_value_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            "head_dim": int(hf.get("head_dim") or 256),
            "vocab_size": int(hf["vocab_size"]),
            "layer_types": types,
            "window": int(hf.get("sliding_window") or 512),
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(full.get("rope_theta", 1_000_000.0)),
            "rope_local_theta": float(local.get("rope_theta", 10_000.0)),
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "max_position_embeddings": int(hf.get("max_position_embeddings", 32768)),
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_id": hf.get("eos_token_id"),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{where}: config lacks or mangles a required field ({e})") from None
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise UnsupportedModelError(f"{where}: layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{where}: hidden_activation {act!r} is not supported for Gemma 3")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(cap) is not None:
            raise UnsupportedModelError(f"{where}: {cap} is not supported yet")
    kind = full.get("rope_type", full.get("type"))
    if kind == "linear":
        cfg["rope_scale"] = 1.0 / float(full["factor"])
    elif kind in ("llama3", "yarn"):
        cfg["rope_scaling"] = {
            "rope_type": kind,
            **{k: v for k, v in full.items() if k not in ("rope_type", "type", "rope_theta")},
        }
    elif kind not in (None, "default"):
        raise UnsupportedModelError(f"{where}: rope_scaling {kind!r} is not supported")
    return cfg


def _gguf_config(hf: dict) -> dict:
    """The query scale llama.cpp's gemma3 graph uses, which its GGUFs do not state: 1/sqrt(head_dim),
    1/sqrt(d_model / heads) for the 27B (62 layers)."""
    big = hf["num_hidden_layers"] == 62
    return {"query_pre_attn_scalar": hf["hidden_size"] // hf["num_attention_heads"] if big else hf["head_dim"]}


# llama.cpp's Gemma 3 GGUFs name the norms before and after each block their own way, and store every
# norm weight as 1 + w (its converter adds the 1 that this graph adds at build).
GGUF = GGUFLayout(
    layer_names={
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    norm_plus_one=True,
    config=_gguf_config,
)


def canonical_tensors(tensors: dict, config: dict, where: str) -> dict:
    """HF names are canonical (a multimodal checkpoint's text model is under language_model.)."""
    out = {}
    for k, v in tensors.items():
        k = k.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
        if "rotary_emb" not in k and not k.startswith(("vision_tower.", "multi_modal_projector.", "model.vision")):
            out[k] = v
    return out


def ffn_parts(config: dict, layer: int) -> dict:
    p = LAYER.format(layer) + "mlp."
    return {"gate": p + "gate_proj", "up": p + "up_proj", "down": p + "down_proj"}


def build(ops, args: ModelArgs, get) -> dict:
    """Resident weights; every RMSNorm weight w as 1 + w (what Gemma's norm multiplies by)."""

    def norm(name):
        w = get(name)
        return None if w is None else w + 1.0

    layers = []
    for i in range(args.num_hidden_layers):
        p = LAYER.format(i)
        layers.append(
            {
                "attn_norm": norm(p + "input_layernorm.weight"),
                "post_attn_norm": norm(p + "post_attention_layernorm.weight"),
                "ffn_norm": norm(p + "pre_feedforward_layernorm.weight"),
                "post_ffn_norm": norm(p + "post_feedforward_layernorm.weight"),
                "qkv": get([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"]),
                "o": get(p + "self_attn.o_proj"),
                "q_norm": norm(p + "self_attn.q_norm.weight"),
                "k_norm": norm(p + "self_attn.k_norm.weight"),
            }
        )
    embed = get("model.embed_tokens")
    head = embed if args.tie_word_embeddings else get("lm_head")
    return {"embed": embed, "norm": norm("model.norm.weight"), "head": head, "layers": layers}


def window_mask(ops, cache_mask, positions, T: int, S: int, window: int):
    """The mask of T new queries at `positions` (their first one's: an int, or one per row) over S
    keys, seeing only the keys of their last `window` positions, combined with the cache's mask."""
    first = np.atleast_1d(np.asarray(positions, np.int64))[:, None] + np.arange(T)[None, :]  # [B or 1, T]
    j = np.arange(S)[None, None, :]
    keep = (j <= first[:, :, None]) & (j > first[:, :, None] - window)  # [B or 1, T, S]
    if isinstance(cache_mask, RowsMask):  # a padded batch's mask
        return ops.mask(keep[:, None] & cache_mask.keep(T, S))
    if cache_mask is not None and not isinstance(cache_mask, str):
        keep = keep[:, None] & ops.to_numpy(cache_mask).astype(bool)
        return ops.mask(keep)
    return ops.mask(keep[:, None])


def attention(ops, args: ModelArgs, lw: dict, x, cache, sliding: bool):
    B, T, _ = x.shape
    hd, Hq, Hk = args.head_dim, args.num_attention_heads, args.num_key_value_heads

    def heads(t, n):  # [B, T, n * hd] -> [B, n, T, hd]
        return ops.transpose(ops.reshape(t, (B, T, n, hd)), (0, 2, 1, 3))

    offset = cache.positions()
    if sliding:
        base, scale, freqs, factor = args.rope_local_theta, 1.0, None, 1.0
    else:
        base, scale = args.rope_theta, args.rope_scale
        freqs, factor = rope_frequencies(hd, base, args.rope_scaling, args.max_position_embeddings)

    def rope(t):
        t = ops.rope(t, hd, args.rope_traditional, base, offset, scale, freqs)
        return t * factor if factor != 1.0 else t

    q, k, v = ops.split(linear(ops, x, lw["qkv"]), [Hq * hd, Hk * hd, Hk * hd])
    q = rope(ops.rms_norm(heads(q, Hq), lw["q_norm"], args.rms_norm_eps))
    k = rope(ops.rms_norm(heads(k, Hk), lw["k_norm"], args.rms_norm_eps))
    k, v = cache.update(ops, k, heads(v, Hk))
    scale_qk = args.query_pre_attn_scalar**-0.5
    cache.observe(ops, q, k, scale_qk)
    S = k.shape[2]
    mask = cache.mask(ops, T)
    if sliding and S > args.window:
        if (mask is None or isinstance(mask, str)) and isinstance(offset, int) and offset == S - T:
            mask = WindowMask(args.window)  # one sequence holding every key: the kernel skips the rest
        else:
            mask = window_mask(ops, mask, offset, T, S, args.window)
    o = cache.attention(ops, q, k, v, scale_qk, mask)
    o = ops.reshape(ops.transpose(o, (0, 2, 1, 3)), (B, T, Hq * hd))
    return linear(ops, o, lw["o"])


GATE_ACTIVATION = GateActivation.GELU_TANH  # GeGLU


def ffn_hidden(ops, args: ModelArgs, fw: FFNWeights, x):
    """GeGLU activations gelu_tanh(gate) * up [.., F] from bundle-form weights (gate|up rows fused [2F, D])."""
    return gated_hidden(ops, GATE_ACTIVATION, fw.gate_up, x)


def mlp(ops, args: ModelArgs, fw: FFNWeights, x):
    """GeGLU over bundle-form weights, whole or as a sparse FFN source gives them (common.gated_mlp)."""
    return gated_mlp(ops, GATE_ACTIVATION, fw, x)


def embed(ops, args: ModelArgs, w: dict, tokens, caches):
    return ops.embedding(w["embed"], tokens) * (args.hidden_size**0.5)


def block(ops, args: ModelArgs, lw: dict, i: int, h, cache, ffn: LayerSource):
    eps = args.rms_norm_eps
    a = attention(ops, args, lw, ops.rms_norm(h, lw["attn_norm"], eps), cache, args.layer_types[i] == SLIDING)
    h = h + ops.rms_norm(a, lw["post_attn_norm"], eps)
    x = ops.rms_norm(h, lw["ffn_norm"], eps)
    return h + ops.rms_norm(mlp(ops, args, ffn.layer(i, x), x), lw["post_ffn_norm"], eps)


def head(ops, args: ModelArgs, w: dict, h, all_logits: bool = False):
    if not all_logits:
        h = ops.last_token(h)
    return ops.linear(ops.rms_norm(h, w["norm"], args.rms_norm_eps), w["head"])


def forward(ops, args: ModelArgs, w: dict, tokens, caches, ffn: LayerSource, all_logits: bool = False):
    h = embed(ops, args, w, tokens, caches)
    for i, lw in enumerate(w["layers"]):
        h = block(ops, args, lw, i, h, caches[i], ffn)
    return head(ops, args, w, h, all_logits)
