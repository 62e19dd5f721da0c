"""Read a GGUF file (whole or split by llama.cpp's gguf-split) into the canonical form of conversion
(source_model.SourceModel): llama.cpp's tensor names mapped to HF ones, the config built from the
metadata (checked before anything divides by it or sizes an array with it), a MoE GGUF's (llama.cpp's
qwen3moe) 3-D expert stacks and its RoPE scaling. Tensors are read one at a time by offset
(tensor_source.GGUFTensors), Q4_0/Q4_1/Q8_0 blocks turned into MLX affine triples (gguf_blocks); the
tokenizer is rebuilt from the metadata by `gguf_tokenizer`. HF directories: sources.py."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from ..errors import ModelFileError, UnsupportedModelError
from ..models import GGUF_MOE_ARCHS, gguf_model_type, model_entry, model_module
from .gguf_header import GGUFHeader, read_gguf_header
from .gguf_tokenizer import check_vocabulary_buildable, save_gguf_tokenizer
from .source_model import SourceModel
from .tensor_source import GGUFTensors

# GGUF tensor names (llama.cpp convention) -> HF names; {i} is the layer. What a family's GGUFs do
# their own way (layer names, norms stored as 1 + w, config the metadata implies) its graph module
# says (models/common.GGUFLayout), and what an architecture's name implies, models.MODEL_TYPES.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
# A MoE layer's experts as 3-D GGUF tensors [experts, rows, columns]; "{}" is the expert, one tensor
# per expert (tensor_source.GGUFTensors splits the stack by offset).
_GGUF_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _gguf_name(name: str, layer_names: Mapping[str, str] = MappingProxyType({})) -> str | None:
    """The HF name of a GGUF tensor; `layer_names` (the family's GGUFLayout) go before the shared ones."""
    base, _, suffix = name.rpartition(".")  # suffix: weight / bias / scales / biases
    if base.startswith("blk."):
        pieces = base.split(".", 2)
        if len(pieces) != 3 or not (pieces[1].isascii() and pieces[1].isdigit()):
            return None  # not blk.<layer>.<role>: a name of no known role
        _, layer, part = pieces
        hf = layer_names.get(part) or _GGUF_LAYER_NAMES.get(part) or _GGUF_EXPERT_NAMES.get(part)
        if hf is None:
            return None
        return f"model.layers.{layer}.{hf}.{suffix}"
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}"
    if name == "rope_freqs.weight":  # read into the config, not stored (_gguf_rope_scaling)
        return name
    return None


def _minus_one(name: str, a: np.ndarray) -> np.ndarray:
    """A norm weight stored as 1 + w, read back as w (float32, as transformers' GGUF loader does)."""
    return a - np.float32(1) if name.endswith("norm.weight") and a.dtype == np.float32 else a


def _gguf_metadata(header: GGUFHeader) -> dict:
    """Every metadata field but the vocabulary arrays (large, read by gguf_tokenizer) as plain values."""
    meta = {}
    for key, field in header.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.model",
        ):
            continue
        meta[key] = field.value
    if "tokenizer.ggml.tokens" in header.fields:
        meta["tokenizer.ggml.n_tokens"] = header.fields["tokenizer.ggml.tokens"].count
    return meta


_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def gguf_parts(path: str) -> list[str]:
    """The files of a split GGUF (llama.cpp's gguf-split: `<name>-00001-of-00003.gguf`; any part's
    path names them all), in order; [path] for a whole file."""
    m = _SPLIT.match(path)
    if not m:
        return [path]
    count = int(m.group(3))
    if not 1 <= count <= 9999 or not 1 <= int(m.group(2)) <= count:
        raise ModelFileError(f"{path}: a split GGUF's name must number its part within 1..N (-00001-of-0000N)")
    parts = [f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing:
        raise ModelFileError(
            f"{path}: {len(missing)} of the {count} parts of this split GGUF are missing "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    return parts


def _open_gguf(path: str) -> tuple[GGUFHeader, dict]:
    """(header, metadata) of one GGUF file, or one line naming what is wrong with it."""
    header = read_gguf_header(path)
    return header, _gguf_metadata(header)


def read_gguf(path: str) -> SourceModel:
    parts = gguf_parts(path)
    path = parts[0]  # the model's metadata and vocabulary are in the first part
    opened = [_open_gguf(p) for p in parts]
    header, meta = opened[0]
    for i, (p, (_, pmeta)) in enumerate(zip(parts, opened)):
        count, no = pmeta.get("split.count"), pmeta.get("split.no")
        if len(parts) > 1 and (count != len(parts) or no != i):
            raise ModelFileError(
                f"{p}: its split metadata (split.no {no}, split.count {count}) does not make it "
                f"part {i + 1} of {len(parts)}"
            )
    arch = str(meta.get("general.architecture", ""))
    check_vocabulary_buildable(path, str(meta.get("tokenizer.ggml.model", "")), arch)

    def m(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    moe = bool(m("expert_count")) or any("_exps." in t.name for t in header.tensors)
    if moe and arch not in GGUF_MOE_ARCHS:
        raise UnsupportedModelError(
            f"{path}: mixture-of-experts GGUF of architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_MOE_ARCHS)})"
        )
    model_type = gguf_model_type(arch)
    mod = model_module(model_type, path)
    implied = model_entry(model_type, path).gguf_config  # what the architecture's name says
    required = ("block_count", "embedding_length", "attention.head_count") + (() if moe else ("feed_forward_length",))
    missing = [f"{arch}.{k}" for k in required if m(k) is None]
    if missing:
        raise ModelFileError(f"{path}: GGUF metadata lacks {', '.join(missing)}")

    def count(key, lo=1, hi=1 << 24, default=None) -> int:
        # metadata is read as whatever type the file says: a count must be a sane integer before
        # anything divides by it or sizes an array with it
        value = m(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ModelFileError(
                f"{path}: GGUF metadata {arch}.{key} = {str(value)[:40]!r} is not an integer in {lo}..{hi}"
            )
        return value

    def number(key, default) -> float:
        value = m(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ModelFileError(f"{path}: GGUF metadata {arch}.{key} = {str(value)[:40]!r} is not a positive number")
        return float(value)

    n_heads = count("attention.head_count", hi=1 << 16)
    d_model = count("embedding_length")
    n_kv = count("attention.head_count_kv", hi=n_heads, default=n_heads)
    if n_heads % n_kv:
        raise ModelFileError(
            f"{path}: GGUF metadata {arch}.attention.head_count_kv {n_kv} does not divide head_count {n_heads}"
        )
    if m("attention.key_length") is None and d_model % n_heads:
        raise ModelFileError(
            f"{path}: GGUF metadata {arch}.attention.head_count {n_heads} does not divide embedding_length {d_model}"
        )
    adjust = _minus_one if mod.GGUF.norm_plus_one else None
    tensors = GGUFTensors(
        path,
        header,
        lambda n: _gguf_name(n, mod.GGUF.layer_names),
        adjust,
        [(p, h) for p, (h, _) in zip(parts[1:], opened[1:])],
    )
    vocab = m("vocab_size") or meta.get("tokenizer.ggml.n_tokens", 0)
    # 0: no vocabulary (a file read for its tensors alone; conversion refuses it when building the tokenizer)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 <= vocab <= 1 << 24:
        raise ModelFileError(
            f"{path}: GGUF vocabulary size {str(vocab)[:40]!r} ({arch}.vocab_size or the number of "
            "tokenizer.ggml.tokens) is not an integer in 0..16777216"
        )
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        value = meta.get(key)
        bad = isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (vocab or 1 << 24)
        if value is not None and bad:
            raise ModelFileError(
                f"{path}: GGUF metadata {key} = {str(value)[:40]!r} is not a token id of the "
                f"vocabulary ({vocab} tokens)"
            )
    hf_config = {
        "model_type": model_type,
        "hidden_size": d_model,
        "intermediate_size": count("feed_forward_length", lo=0, default=0),
        "num_hidden_layers": count("block_count", hi=1 << 16),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": count("attention.key_length", hi=1 << 14, default=d_model // n_heads),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": number("rope.freq_base", 10000.0),
        "rope_traditional": False,  # unless the architecture implies it
        "max_position_embeddings": count("context_length", hi=1 << 26, default=4096),
        "vocab_size": vocab,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if moe:
        hf_config.update(_gguf_moe_config(path, arch, m, tensors))
    hf_config.update(implied)
    if m("attention.sliding_window") is not None:
        hf_config["sliding_window"] = count("attention.sliding_window", hi=1 << 26)
    if mod.GGUF.config is not None:
        hf_config.update(mod.GGUF.config(hf_config))
    scaling = _gguf_rope_scaling(path, m, tensors)
    if scaling:
        hf_config["rope_scaling"] = scaling
    config = mod.normalize_config(hf_config, path)
    quant = tensors.quant_specs()

    def save_tokenizer(out_dir: str) -> None:
        save_gguf_tokenizer(path, out_dir)

    return SourceModel(
        config,
        tensors,
        quant,
        save_tokenizer,
        {
            "kind": "gguf",
            "file": os.path.basename(path),
            "size": sum(map(os.path.getsize, parts)),
            **({"parts": len(parts)} if len(parts) > 1 else {}),
        },
    )


def _gguf_rope_scaling(path: str, m, tensors: GGUFTensors) -> dict | None:
    """The HF rope_scaling of a GGUF: its rope_freqs tensor (llama.cpp writes Llama 3.x's "llama3"
    scaling as each pair's divisor; taken out of the tensors, it becomes {"rope_type": "factors"}),
    or its rope.scaling.* metadata ("linear", "yarn")."""
    kind = m("rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        if kind not in (None, "none"):
            raise ModelFileError(f"{path}: both a rope_freqs tensor and rope.scaling.type {kind!r}: which applies?")
        factors = tensors.pop_numpy("rope_freqs.weight")
        if factors.dtype != np.float32 or factors.ndim != 1:
            raise ModelFileError(f"{path}: rope_freqs is {factors.dtype} {list(factors.shape)}, not a float32 vector")
        return {"rope_type": "factors", "factors": [float(f) for f in factors]}
    if kind in (None, "none"):
        return None
    factor = m("rope.scaling.factor")
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": m("rope.scaling.original_context_length"),
        }
    raise UnsupportedModelError(
        f"{path}: RoPE scaling {kind!r} is not supported (supported: linear, yarn, and Llama 3.x's rope_freqs)"
    )


def _gguf_moe_config(path: str, arch: str, m, tensors: GGUFTensors) -> dict:
    """The HF MoE fields a MoE GGUF's metadata states; every stack of experts must hold expert_count
    of them (what its architecture implies, qwen3moe's norm_topk_prob, is in models.MODEL_TYPES)."""
    keys = {
        "num_experts": "expert_count",
        "num_experts_per_tok": "expert_used_count",
        "moe_intermediate_size": "expert_feed_forward_length",
    }
    missing = [f"{arch}.{k}" for k in keys.values() if m(k) is None]
    if missing:
        raise ModelFileError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    cfg = {}
    for hf, k in keys.items():
        value = m(k)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 24:
            raise ModelFileError(
                f"{path}: GGUF metadata {arch}.{k} = {str(value)[:40]!r} is not an integer in 1..16777216"
            )
        cfg[hf] = value
    for name, n in tensors.stacks().items():
        if n != cfg["num_experts"]:
            raise ModelFileError(f"{path}: {name} holds {n} experts, but {arch}.expert_count is {cfg['num_experts']}")
    return cfg
