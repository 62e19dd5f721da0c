"""An mlx-lm model directory (Hugging Face layout) built from a llama GGUF, so that mlx-lm can run
on the very weights our engine runs (`python -m mlx_flash.bench batch-peers` compares the two).

  build_peer_dir(gguf, cache_dir, dtype) -> path   built once into <cache_dir>/peers/, keyed by the file

What it writes:
- config.json from the GGUF's metadata (llama only). The GGUF keeps llama.cpp's q/k row order (its
  converter permutes the rows for the interleaved RoPE), so rope_traditional is true, as our
  converter sets it.
- model.safetensors: the GGUF's tensors under the HF names mlx-lm's llama reads. Packed Q4_0 /
  Q4_1 / Q8_0 tensors come from mx.load already as mlx's affine layout (weight words, scales,
  biases; group 32), which is mlx-lm's quantized layout: the same numbers, written as they are.
  Every other tensor (scales, biases, norms) is cast to `dtype`; float16 is the GGUF's own, but
  MLX's CPU quantized_matmul runs it ~80x slower than float32.
- the tokenizer our converter builds from the GGUF (gguf_tokenizer.py).

Only mlx is needed (imported when used); mlx-lm itself runs elsewhere, in its own environment.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

from ..durable import replace_folder, write_json
from ..errors import ModelFileError
from ..store.atomic_dir import OutputError
from .gguf_tokenizer import save_gguf_tokenizer

PEER_FORMAT = 1  # bump when the model directory written here changes: it is part of the cache key

# GGUF tensor names (llama.cpp) -> the HF names mlx-lm's llama reads; {i} is the layer.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def meta_value(v):
    """An mx.load GGUF metadata value as a plain Python value: numbers come as mx.arrays (one
    element: the number; more: a list), strings and lists of strings as they are."""
    import mlx.core as mx

    if isinstance(v, mx.array):
        return v.item() if v.size == 1 else v.tolist()
    return v


def peer_config(meta: dict, names: set, quant: dict, gguf: str) -> dict:
    """mlx-lm's config.json (llama) from the GGUF's metadata; `names` are the HF tensor names
    written (no lm_head: tied embeddings), `quant` mlx-lm's quantization entry."""
    arch = meta_value(meta.get("general.architecture", ""))
    if arch != "llama":
        raise ModelFileError(f"{gguf}: architecture {arch!r}; this tool builds mlx-lm directories of llama GGUFs only")

    def m(key, default=None):
        v = meta.get(f"llama.{key}")
        return default if v is None else meta_value(v)

    heads = int(m("attention.head_count"))
    d = int(m("embedding_length"))
    eos = meta_value(meta.get("tokenizer.ggml.eos_token_id"))
    bos = meta_value(meta.get("tokenizer.ggml.bos_token_id"))
    n_vocab = m("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return {
        "model_type": "llama",
        "hidden_size": d,
        "num_hidden_layers": int(m("block_count")),
        "intermediate_size": int(m("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m("attention.head_count_kv", heads)),
        "head_dim": int(m("attention.key_length", d // heads)),
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(n_vocab),
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes q/k rows for the interleaved RoPE: rotate them as stored
        "rope_traditional": True,
        "max_position_embeddings": int(m("context_length", 4096)),
        "tie_word_embeddings": "lm_head.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "quantization": quant,
    }


def hf_name(name: str) -> str:
    """The HF name mlx-lm's llama reads for a GGUF tensor name ("blk.3.attn_q.scales" ->
    "model.layers.3.self_attn.q_proj.scales"); a tensor with no place there is an error."""
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[part]}.{suffix}"
    elif base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    raise ModelFileError(f"GGUF tensor {name!r} has no place in mlx-lm's llama")


def build_peer_dir(gguf: str, cache_dir: str, dtype: str) -> str:
    """mlx-lm's model directory for `gguf` (built once into cache_dir/peers/, keyed by the file's
    path, size and mtime, `dtype` and PEER_FORMAT; written to a temporary directory and renamed,
    so a directory with a config.json is complete)."""
    import mlx.core as mx

    st = os.stat(gguf)
    key = hashlib.sha256(f"{os.path.abspath(gguf)}|{st.st_size}|{int(st.st_mtime)}|{dtype}|{PEER_FORMAT}".encode())
    name = os.path.splitext(os.path.basename(gguf))[0]
    out = os.path.join(cache_dir, "peers", f"{name}-mlxlm-{dtype}-{key.hexdigest()[:12]}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    print(f"building mlx-lm's model directory {out}", file=sys.stderr)
    weights, meta = mx.load(gguf, return_metadata=True)
    tensors, bits = {}, {}
    for k, v in weights.items():
        name = hf_name(k)
        if v.dtype == mx.uint32:  # packed words: Q4_0 / Q4_1 / Q8_0 come as weight/scales/biases
            scales = weights.get(k.rsplit(".", 1)[0] + ".scales")
            if scales is None:
                raise ModelFileError(f"{gguf}: tensor {k} is packed in a form other than weight/scales/biases")
            bits[name.rsplit(".", 1)[0]] = v.shape[-1] // scales.shape[-1]  # words per group of 32 = bits
        tensors[name] = v if v.dtype == mx.uint32 else v.astype(getattr(mx, dtype))
    # the most common width for all, and the layers of another width (SmolLM2's Q4_1 GGUF keeps its
    # embedding at 8 bits) by name, as mlx-lm's per-layer quantization config reads them
    common = max(set(bits.values()), key=list(bits.values()).count)
    quant = {"group_size": 32, "bits": common}
    quant.update({base: {"group_size": 32, "bits": b} for base, b in sorted(bits.items()) if b != common})
    config = peer_config(meta, set(tensors), quant, gguf)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(out))
    # mlx writes the weights itself; replace_folder fsyncs them with the rest before the rename
    mx.save_safetensors(os.path.join(tmp, "model.safetensors"), tensors)
    save_gguf_tokenizer(gguf, tmp)
    write_json(os.path.join(tmp, "config.json"), config, OutputError, in_folder=True)
    replace_folder(tmp, out, OutputError)
    return out
