"""OPT graph: ReLU FFN, learned positions (offset 2), biases everywhere, pre- or post-LayerNorm.

Shapes: B batch, T tokens, D d_model, F d_ff (ffn_dim), H heads, hd head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..ffn_source import FFNWeights, LayerSource
from .common import ArgsFromDict, GGUFLayout

LAYER = "model.decoder.layers.{}."
POSITION_OFFSET = 2  # OPT's learned position table reserves its first two rows
GGUF = GGUFLayout()  # llama.cpp writes no OPT; a GGUF that says it is one is read with the shared names


@dataclass
class ModelArgs(ArgsFromDict):
    model_type: str
    hidden_size: int
    ffn_dim: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    activation_function: str = "relu"
    layer_norm_eps: float = 1e-5
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    sliding_window: int | None = None  # OPT attends over its whole context

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def normalize_config(hf: dict, where: str) -> dict:
    try:
        cfg = {
            "model_type": "opt",
            "hidden_size": int(hf["hidden_size"]),
            "ffn_dim": int(hf["ffn_dim"]),
            "intermediate_size": int(hf["ffn_dim"]),
            "num_hidden_layers": int(hf["num_hidden_layers"]),
            "num_attention_heads": int(hf["num_attention_heads"]),
            "vocab_size": int(hf["vocab_size"]),
            "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
            "do_layer_norm_before": bool(hf.get("do_layer_norm_before", True)),
            "word_embed_proj_dim": int(hf.get("word_embed_proj_dim") or hf["hidden_size"]),
            "activation_function": hf.get("activation_function", "relu"),
            "layer_norm_eps": float(hf.get("layer_norm_eps", 1e-5)),
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_id": hf.get("eos_token_id"),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{where}: config lacks or mangles a required field ({e})") from None
    if cfg["activation_function"] not in ("relu", "gelu"):
        raise UnsupportedModelError(f"{where}: OPT activation {cfg['activation_function']!r} is not supported")
    if hf.get("enable_bias", True) is False or hf.get("layer_norm_elementwise_affine", True) is False:
        raise UnsupportedModelError(f"{where}: OPT without biases or affine LayerNorm is not supported")
    return cfg


def canonical_tensors(tensors: dict, config: dict, where: str) -> dict:
    """Checkpoints saved from OPTModel lack the "model." prefix; tied heads may be omitted."""
    out = {}
    for k, v in tensors.items():
        out[k if k.startswith(("model.", "lm_head")) else "model." + k] = v
    return out


def ffn_parts(config: dict, layer: int) -> dict:
    p = LAYER.format(layer)
    # fc1's bias is one value per neuron, so it travels inside the bundle; fc2's bias stays resident.
    return {"up": p + "fc1", "down": p + "fc2"}


def build(ops, args: ModelArgs, get) -> dict:
    layers = []
    for i in range(args.num_hidden_layers):
        p = LAYER.format(i)
        layers.append(
            {
                "q": get(p + "self_attn.q_proj"),
                "k": get(p + "self_attn.k_proj"),
                "v": get(p + "self_attn.v_proj"),
                "o": get(p + "self_attn.out_proj"),
                "attn_ln": (get(p + "self_attn_layer_norm.weight"), get(p + "self_attn_layer_norm.bias")),
                "ffn_ln": (get(p + "final_layer_norm.weight"), get(p + "final_layer_norm.bias")),
                "fc2_bias": get(p + "fc2.bias"),
            }
        )
    d = "model.decoder."
    final = get(d + "final_layer_norm.weight", optional=True)
    embed = get(d + "embed_tokens")
    return {
        "embed": embed,
        "positions": get(d + "embed_positions"),
        "project_in": get(d + "project_in", optional=True),
        "project_out": get(d + "project_out", optional=True),
        "final_ln": (final, get(d + "final_layer_norm.bias")) if final is not None else None,
        "head": get("lm_head", optional=True) or embed,
        "layers": layers,
    }


def attention(ops, args: ModelArgs, lw: dict, x, cache):
    B, T, _ = x.shape
    H, hd = args.num_attention_heads, args.head_dim
    split = lambda y: ops.transpose(ops.reshape(y, (B, T, H, hd)), (0, 2, 1, 3))  # noqa: E731
    q, k, v = split(ops.linear(x, lw["q"])), split(ops.linear(x, lw["k"])), split(ops.linear(x, lw["v"]))
    k, v = cache.update(ops, k, v)
    cache.observe(ops, q, k, hd**-0.5)
    o = cache.attention(ops, q, k, v, hd**-0.5, cache.mask(ops, T))
    return ops.linear(ops.reshape(ops.transpose(o, (0, 2, 1, 3)), (B, T, H * hd)), lw["o"])


def ffn_hidden(ops, args: ModelArgs, fw: FFNWeights, x):
    """fc1 rows (with their per-neuron bias) [F, D], then the activation: [.., F]."""
    hidden = ops.linear(x, fw.up)
    return ops.relu(hidden) if args.activation_function == "relu" else ops.gelu(hidden)


def mlp(ops, args: ModelArgs, fw: FFNWeights, x, fc2_bias):
    """fc2 maps the F activations to D (its stored orientation: weights.neuron_arrays). A sparse FFN
    source may zero neurons with fw.mask."""
    hidden = ffn_hidden(ops, args, fw, x)
    if fw.mask is not None:
        hidden = hidden * fw.mask
    return ops.linear(hidden, fw.down) + fc2_bias


def embed(ops, args: ModelArgs, w: dict, tokens, caches):
    """tokens [B, T] -> the residual stream h [B, T, D]: token and learned position embeddings."""
    T = tokens.shape[1]
    h = ops.embedding(w["embed"], tokens)
    if w["project_in"] is not None:
        h = ops.linear(h, w["project_in"])
    return h + ops.embedding(w["positions"], ops.positions(caches[0].positions() + POSITION_OFFSET, T))


def block(ops, args: ModelArgs, lw: dict, i: int, h, cache, ffn: LayerSource):
    """Layer i on h [B, T, D] (layer norms before or after each half, as the config says)."""
    eps, pre = args.layer_norm_eps, args.do_layer_norm_before
    x = ops.layer_norm(h, *lw["attn_ln"], eps) if pre else h
    h = h + attention(ops, args, lw, x, cache)
    if not pre:
        h = ops.layer_norm(h, *lw["attn_ln"], eps)
    x = ops.layer_norm(h, *lw["ffn_ln"], eps) if pre else h
    h = h + mlp(ops, args, ffn.layer(i, x), x, lw["fc2_bias"])
    return h if pre else ops.layer_norm(h, *lw["ffn_ln"], eps)


def head(ops, args: ModelArgs, w: dict, h, all_logits: bool = False):
    """h [B, T, D] -> logits [B, T or 1, vocab]."""
    if not all_logits:
        h = ops.last_token(h)
    if w["final_ln"] is not None:
        h = ops.layer_norm(h, *w["final_ln"], args.layer_norm_eps)
    if w["project_out"] is not None:
        h = ops.linear(h, w["project_out"])
    return ops.linear(h, w["head"])


def forward(ops, args: ModelArgs, w: dict, tokens, caches, ffn: LayerSource, all_logits: bool = False):
    """tokens [B, T] -> logits [B, T or 1, vocab]; `ffn.layer(i, x)` supplies layer i's FFN weights."""
    h = embed(ops, args, w, tokens, caches)
    for i, lw in enumerate(w["layers"]):
        h = block(ops, args, lw, i, h, caches[i], ffn)
    return head(ops, args, w, h, all_logits)
