"""Synthetic stores of real large shapes (e.g. Llama-2-7B) with random float16 weights, and a
labelled statistical model of neuron activity to drive them. Everything measured on them is
synthetic: the bytes and the read pattern are real, the weights and the activity are not.

A random weight is any float16 bit pattern with the top exponent bit cleared (finite, |w| < 2),
drawn fresh for every byte so no layer repeats another.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from ..errors import ConfigError
from ..durable import FolderFile, write_new
from ..store.atomic_dir import OutputError, atomic_dir
from ..store.bundles import plan_fields
from ..store.manifest import ALIGNMENT, FFN_FILE, MANIFEST_NAME, RESIDENT_FILE, FFNLayout, Manifest
from ..sparse.statistical import StatisticalActivity  # noqa: F401  (the model these stores are driven by)
from ..store.safetensors_io import safetensors_layout

SHAPES = {
    # Llama-2-7B: 32 layers, d_model 4096, d_ff 11008, 32 heads (no GQA), vocab 32000.
    "llama-2-7b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_traditional": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "sliding_window": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Mistral-7B: Llama-2-7B's layout with grouped-query attention (32/8 heads) and a wider FFN: its KV
    # cache is a quarter of Llama-2's per token, the shape of today's 7-8B dense models.
    "mistral-7b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "rope_traditional": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Mixtral-8x7B: 32 layers, d_model 4096, 8 experts of 14336 neurons, top-2, GQA 32/8 heads.
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 8 * 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "rope_traditional": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 14336,
        "norm_topk_prob": True,
    },
    # Qwen3-30B-A3B: 48 layers, d_model 2048, 128 experts of 768 neurons, top-8 renormalized, GQA 32/4
    # heads of 128 (wider than d_model / heads), per-head q/k RMSNorm, no shared expert, vocab 151936.
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 128 * 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 151936,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "rope_traditional": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "sliding_window": None,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}
# model_types whose attention has per-head q/k RMSNorm weights ([head_dim] each).
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
_CHUNK = 64 << 20


def _random_f16_bytes(rng, n: int) -> bytes:
    w = np.frombuffer(rng.bytes(n), dtype=np.uint16) & np.uint16(0xBFFF)
    return w.tobytes()


def _put(fh, b: bytes, digest) -> None:
    fh.write(b)
    digest.update(b)


def _write_random(fh, rng, n: int, digest, bar) -> None:
    while n:
        k = min(_CHUNK, n)
        _put(fh, _random_f16_bytes(rng, k), digest)
        n -= k
        bar.update(k)


def make_synthetic_store(
    out_dir: str, shape: str = "llama-2-7b", layers: int | None = None, seed: int = 0, progress: bool = False
) -> str:
    """Write a store of this shape (optionally only the first `layers` layers) with random float16
    weights; atomic like the converter (a hidden .partial directory renamed at the end)."""
    from tqdm import tqdm

    if shape not in SHAPES:
        raise ConfigError(f"synthetic shape {shape!r} is unknown (choose one of: {', '.join(SHAPES)})")
    cfg = dict(SHAPES[shape])
    if layers is not None:
        cfg["num_hidden_layers"] = int(layers)
    L, D, F, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, H, Hk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    resident = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D], "lm_head.weight": [V, D]}
    for i in range(L):
        p = f"model.layers.{i}."
        resident.update(
            {
                p + "input_layernorm.weight": [D],
                p + "post_attention_layernorm.weight": [D],
                p + "self_attn.q_proj.weight": [H * hd, D],
                p + "self_attn.k_proj.weight": [Hk * hd, D],
                p + "self_attn.v_proj.weight": [Hk * hd, D],
                p + "self_attn.o_proj.weight": [D, H * hd],
            }
        )
        if cfg["model_type"] in QK_NORM_TYPES:
            resident.update({p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]})
        if cfg.get("num_experts"):
            resident[p + "mlp.gate.weight"] = [cfg["num_experts"], D]
    fields, bundle_bytes = plan_fields(
        [(f"{r}.weight", np.empty((0, D), np.float16), "float16") for r in ("gate", "up", "down")]
    )
    out_dir = os.path.abspath(out_dir)
    rng = np.random.default_rng(seed)
    total = sum(int(np.prod(s)) * 2 for s in resident.values()) + L * F * bundle_bytes
    files = {}
    with atomic_dir(out_dir) as tmp:
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"synthetic {shape}", disable=not progress) as bar:
            head, tensors = safetensors_layout({n: (shp, "float16") for n, shp in resident.items()}, RESIDENT_FILE)
            digest = hashlib.sha256()
            with FolderFile(os.path.join(tmp, RESIDENT_FILE), OutputError) as fh:  # (atomic_dir's folder)
                _put(fh, head, digest)
                for n in sorted(resident):
                    if n.endswith("norm.weight"):  # norms of ones keep activations in range
                        _put(fh, np.ones(resident[n], np.float16).tobytes(), digest)
                        bar.update(tensors[n].nbytes)
                    else:
                        _write_random(fh, rng, tensors[n].nbytes, digest, bar)
            files[RESIDENT_FILE] = {
                "size": os.path.getsize(os.path.join(tmp, RESIDENT_FILE)),
                "sha256": digest.hexdigest(),
            }
            digest = hashlib.sha256()
            offsets = []
            with FolderFile(os.path.join(tmp, FFN_FILE), OutputError) as fh:
                for _ in range(L):
                    _put(fh, b"\0" * (-fh.tell() % ALIGNMENT), digest)
                    offsets.append(fh.tell())
                    _write_random(fh, rng, F * bundle_bytes, digest, bar)
                _put(fh, b"\0" * (-fh.tell() % ALIGNMENT), digest)
            files[FFN_FILE] = {"size": os.path.getsize(os.path.join(tmp, FFN_FILE)), "sha256": digest.hexdigest()}
        ffn = FFNLayout(
            file=FFN_FILE,
            gated=True,
            n_neurons=F,
            d_model=D,
            bundle_bytes=bundle_bytes,
            fields=fields,
            quant={"gate": None, "up": None, "down": None},
            layer_offsets=offsets,
            precision="f16",
            n_experts=cfg.get("num_experts", 0),
        )
        m = Manifest(
            config=cfg,
            tensors=tensors,
            quant={},
            ffn=ffn,
            files=files,
            source={"synthetic": shape, "seed": seed, "note": "random weights; results are synthetic"},
        )
        write_new(os.path.join(tmp, MANIFEST_NAME), [m.to_json().encode()], OutputError)
    return out_dir
