"""Llama-family graph: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2.

GQA, RoPE in both layouts (interleaved "traditional" as stored by GGUF llama, halves as in HF),
tied or untied embeddings, optional q/k RMSNorm (Qwen3) and q/k/v(/o) biases (Qwen2, some Llamas).
Shapes: B batch, T tokens, D d_model, F d_ff, H heads, hd head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedModelError
from ..ffn_source import FFNWeights, GateActivation, LayerSource
from .common import ArgsFromDict, GGUFLayout, gated_hidden, gated_mlp, linear
from .rope import SCALINGS, rope_frequencies

LAYER = "model.layers.{}."
GGUF = GGUFLayout()  # llama.cpp's own family: its GGUFs use the shared names


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
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scale: float = 1.0
    rope_scaling: dict | None = None  # "llama3" or "yarn" frequencies (models/rope.py)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None  # not implemented: the engine refuses contexts longer than it
    qk_norm_full: bool = False  # OLMoE: q/k RMSNorm over the whole projection, not per head
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    extra: dict = field(default_factory=dict)


def normalize_config(hf: dict, where: str) -> dict:
    try:
        n_heads = int(hf["num_attention_heads"])
        d = int(hf["hidden_size"])
        cfg = {
            "model_type": hf["model_type"],
            "hidden_size": d,
            "intermediate_size": int(hf["intermediate_size"]),
            "num_hidden_layers": int(hf["num_hidden_layers"]),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(hf.get("num_key_value_heads") or n_heads),
            "head_dim": int(hf.get("head_dim") or d // n_heads),
            "vocab_size": int(hf["vocab_size"]),
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
            "rope_theta": float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            "rope_traditional": bool(hf.get("rope_traditional", False)),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)),
            "sliding_window": (
                int(hf["sliding_window"]) if hf.get("sliding_window") and hf.get("use_sliding_window", True) else None
            ),
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_id": hf.get("eos_token_id"),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{where}: config lacks or mangles a required field ({e})") from None
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {act!r} is not supported for {hf['model_type']}")
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    try:
        if kind == "linear":
            cfg["rope_scale"] = 1.0 / float(scaling["factor"])
        elif kind == "llama3":
            cfg["rope_scaling"] = {
                "rope_type": kind,
                **{
                    k: float(scaling[k])
                    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                },
            }
        elif kind == "yarn":
            cfg["rope_scaling"] = {
                "rope_type": kind,
                **{
                    k: scaling[k]
                    for k in (
                        "factor",
                        "original_max_position_embeddings",
                        "beta_fast",
                        "beta_slow",
                        "mscale",
                        "mscale_all_dim",
                        "attention_factor",
                        "truncate",
                    )
                    if scaling.get(k) is not None
                },
            }
        elif kind == "factors":  # a GGUF's rope_freqs: llama.cpp's per-pair divisors (Llama 3.x files)
            factors = [float(f) for f in scaling["factors"]]
            if len(factors) != cfg["head_dim"] // 2 or not all(0 < f < float("inf") for f in factors):
                raise ValueError(f"{len(factors)} factors for {cfg['head_dim'] // 2} pairs, each positive and finite")
            cfg["rope_scaling"] = {"rope_type": kind, "factors": factors}
        elif kind not in (None, "default"):
            raise UnsupportedModelError(
                f"{where}: rope_scaling {kind!r} is not supported (supported: {', '.join(SCALINGS)})"
            )
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{where}: rope_scaling {kind!r} lacks or mangles a field ({e})") from None
    return cfg


def canonical_tensors(tensors: dict, config: dict, where: str) -> dict:
    """HF names are already canonical; drop buffers HF checkpoints sometimes carry."""
    return {k: v for k, v in tensors.items() if "rotary_emb" not in k}


def ffn_parts(config: dict, layer: int) -> dict:
    p = LAYER.format(layer) + "mlp."
    return {"gate": p + "gate_proj", "up": p + "up_proj", "down": p + "down_proj"}


def build(ops, args: ModelArgs, get) -> dict:
    """Resident weights as backend objects. `get(name)` returns a backend Weight for a linear or
    embedding (name without .weight) and a backend array for a vector (full name); None if absent."""
    layers = []
    for i in range(args.num_hidden_layers):
        p = LAYER.format(i)
        layers.append(
            {
                "attn_norm": get(p + "input_layernorm.weight"),
                "ffn_norm": get(p + "post_attention_layernorm.weight"),
                # q, k, v fused along the output axis: one matmul instead of three.
                "qkv": get([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"]),
                "o": get(p + "self_attn.o_proj"),
                "q_norm": get(p + "self_attn.q_norm.weight", optional=True),
                "k_norm": get(p + "self_attn.k_norm.weight", optional=True),
            }
        )
    embed = get("model.embed_tokens")
    head = embed if args.tie_word_embeddings else get("lm_head")
    return {"embed": embed, "norm": get("model.norm.weight"), "head": head, "layers": layers}


def attention(ops, args: ModelArgs, lw: dict, x, cache):
    B, T, _ = x.shape
    hd, Hq, Hk = args.head_dim, args.num_attention_heads, args.num_key_value_heads

    def heads(t, n):  # [B, T, n * hd] -> [B, n, T, hd]
        return ops.transpose(ops.reshape(t, (B, T, n, hd)), (0, 2, 1, 3))

    offset = cache.positions()
    freqs, factor = rope_frequencies(hd, args.rope_theta, args.rope_scaling, args.max_position_embeddings)

    def rope(t):
        t = ops.rope(t, hd, args.rope_traditional, args.rope_theta, offset, args.rope_scale, freqs)
        return t * factor if factor != 1.0 else t  # YaRN: queries and keys both scaled

    qkv = linear(ops, x, lw["qkv"])
    if lw["q_norm"] is None:  # q and k rotated together as Hq + Hk heads: one rope instead of two
        qk, v = ops.split(qkv, [(Hq + Hk) * hd, Hk * hd])
        qk = rope(heads(qk, Hq + Hk))
        q, k = qk[:, :Hq], qk[:, Hq:]
    else:
        q, k, v = ops.split(qkv, [Hq * hd, Hk * hd, Hk * hd])
        if args.qk_norm_full:  # OLMoE: RMSNorm over the whole q and k projections, before the heads split
            q, k = (
                heads(ops.rms_norm(q, lw["q_norm"], args.rms_norm_eps), Hq),
                heads(ops.rms_norm(k, lw["k_norm"], args.rms_norm_eps), Hk),
            )
        else:  # Qwen3: per-head RMSNorm before RoPE
            q, k = (
                ops.rms_norm(heads(q, Hq), lw["q_norm"], args.rms_norm_eps),
                ops.rms_norm(heads(k, Hk), lw["k_norm"], args.rms_norm_eps),
            )
        q, k = rope(q), rope(k)
    k, v = cache.update(ops, k, heads(v, Hk))
    cache.observe(ops, q, k, hd**-0.5)
    o = cache.attention(ops, q, k, v, hd**-0.5, cache.mask(ops, T))
    return ops.linear(ops.reshape(ops.transpose(o, (0, 2, 1, 3)), (B, T, Hq * hd)), lw["o"])


GATE_ACTIVATION = GateActivation.SILU  # SwiGLU


def ffn_hidden(ops, args: ModelArgs, fw: FFNWeights, x):
    """SwiGLU activations silu(gate) * up [.., F] from bundle-form weights (gate|up rows fused [2F, D])."""
    return gated_hidden(ops, GATE_ACTIVATION, fw.gate_up, x)


def mlp(ops, args: ModelArgs, fw: FFNWeights, x):
    """SwiGLU over bundle-form weights, whole or as a sparse FFN source gives them (common.gated_mlp)."""
    return gated_mlp(ops, GATE_ACTIVATION, fw, x)


def embed(ops, args: ModelArgs, w: dict, tokens, caches):
    """tokens [B, T] -> the residual stream h [B, T, D]."""
    return ops.embedding(w["embed"], tokens)


def block(ops, args: ModelArgs, lw: dict, i: int, h, cache, ffn: LayerSource):
    """Layer i on h [B, T, D]: attention with its cache, then the FFN `ffn.layer(i, x)` supplies."""
    eps = args.rms_norm_eps
    h = h + attention(ops, args, lw, ops.rms_norm(h, lw["attn_norm"], eps), cache)
    x = ops.rms_norm(h, lw["ffn_norm"], eps)
    return h + mlp(ops, args, ffn.layer(i, x), x)


def head(ops, args: ModelArgs, w: dict, h, all_logits: bool = False):
    """h [B, T, D] -> logits [B, T or 1, vocab]."""
    if not all_logits:
        h = ops.last_token(h)
    return ops.linear(ops.rms_norm(h, w["norm"], args.rms_norm_eps), w["head"])


def forward(ops, args: ModelArgs, w: dict, tokens, caches, ffn: LayerSource, all_logits: bool = False):
    """tokens [B, T] -> logits [B, T or 1, vocab]. `ffn.layer(i, x)` supplies layer i's FFN weights
    for FFN input x: resident, freshly read from the bundle file, or only the rows x needs."""
    h = embed(ops, args, w, tokens, caches)
    for i, lw in enumerate(w["layers"]):
        h = block(ops, args, lw, i, h, caches[i], ffn)
    return head(ops, args, w, h, all_logits)
