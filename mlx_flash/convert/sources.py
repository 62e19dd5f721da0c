"""Read a source checkpoint (GGUF file, HF directory, mlx-community quantized directory) into one
canonical form (source_model.SourceModel): HF-style tensor names, a normalized config and per-linear
quantization. `read_source` tells the kinds apart; GGUF files are read by gguf_source.py, HF and
mlx-community directories here.

This is conversion-time code. Tensors are read one at a time (tensor_source): a GGUF by offset, its
Q4_0/Q4_1/Q8_0 blocks turned into MLX affine triples (gguf_blocks), a MoE GGUF's (llama.cpp's
qwen3moe) 3-D expert tensors one expert at a time; safetensors through `mx.load`,
which reads a tensor only when it is evaluated. A GGUF's tokenizer is rebuilt from its metadata by
`gguf_tokenizer`.
"""

from __future__ import annotations

import glob
import json
import os

from ..durable import copy_new
from ..errors import ModelFileError, ModelNotFoundError, UnsupportedModelError
from ..models import model_module
from ..quant_spec import QuantSpec
from ..store.atomic_dir import OutputError
from .gguf_source import read_gguf
from .gguf_tokenizer import save_through_transformers
from .source_model import SourceModel
from .tensor_source import ArrayTensors

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def read_source(path: str) -> SourceModel:
    if not os.path.exists(path):
        raise ModelNotFoundError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if not os.path.exists(os.path.join(path, "config.json")) and len(ggufs) == 1:
            return read_gguf(ggufs[0])
        return read_hf_dir(path)
    return read_gguf(path)


# ---- HF / mlx-community directories ------------------------------------------------------------


def read_hf_dir(path: str) -> SourceModel:
    import mlx.core as mx

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelFileError(f"{path}: no config.json (expected an HF model directory or a GGUF file)")
    try:
        with open(cfg_path) as fh:
            hf_config = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{cfg_path}: not valid JSON ({e})") from None
    if "model_type" not in hf_config:
        raise ModelFileError(f"{cfg_path}: has no model_type")
    mod = model_module(hf_config["model_type"], cfg_path)
    config = mod.normalize_config(hf_config, cfg_path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelFileError(f"{path}: no *.safetensors weight files")
    tensors = {}
    for f in files:
        try:
            tensors.update(mx.load(f))
        except (RuntimeError, ValueError) as e:
            raise ModelFileError(f"{f}: unreadable safetensors ({e})") from None
    tensors = mod.canonical_tensors(tensors, config, path)
    q = hf_config.get("quantization") or hf_config.get("quantization_config")
    quant = {}
    if q and "bits" in q and "group_size" in q:  # mlx-community affine quantization
        spec = QuantSpec(bits=int(q["bits"]), group_size=int(q["group_size"]))
        quant = {n[: -len(".scales")]: spec for n in tensors if n.endswith(".scales")}
        for base, per in q.items():  # per-layer overrides ({"model.layers.0.mlp.gate_proj": {...}})
            if isinstance(per, dict) and base in quant:
                quant[base] = QuantSpec(bits=int(per["bits"]), group_size=int(per["group_size"]))
    elif q:
        raise UnsupportedModelError(f"{cfg_path}: quantization {q.get('quant_method', q)!r} is not supported")

    def save_tokenizer(out_dir: str) -> None:
        found = False
        for name in TOKENIZER_FILES:
            src = os.path.join(path, name)
            if os.path.isfile(src):
                copy_new(src, os.path.join(out_dir, name), OutputError)  # (into the store's folder)
                found = found or name.startswith("tokenizer")
        if not found:
            raise ModelFileError(f"{path}: no tokenizer files (tokenizer.json or tokenizer.model)")
        if not os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
            save_through_transformers(path, out_dir, "a tokenizer.model without tokenizer.json", path)

    return SourceModel(
        config,
        ArrayTensors(tensors),
        quant,
        save_tokenizer,
        {"kind": "hf", "dir": os.path.basename(os.path.abspath(path))},
    )
