"""Write a MoE-fied copy of a dense Llama-family model as an HF-style directory (model_type
`moefied_llama`) that the converter reads like any MoE checkpoint. See moefication.py for the method.

Non-FFN tensors are copied as they are (4-bit stays 4-bit); each expert holds its neurons' gate, up
and down rows, dequantized to float16 when the source is quantized (the numbers the f16 store holds).
The directory's config.json carries how it was made ("moefication") so reports can say it is derived.
"""

from __future__ import annotations

import os

import numpy as np

from ..api import load
from ..durable import write_json
from ..errors import ConfigError, UnsupportedModelError
from ..store.atomic_dir import OutputError, atomic_dir
from .moefication import balanced_clusters, expert_contributions, expert_order, router_quality, train_router
from ..convert.sources import read_source
from .activations import collect
from ..default_model import default_model_path


def dense_ffn(src, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """(gate [F, D], up [F, D], down [D, F]) float32 of one dense layer, and the dtype to store them in."""
    import mlx.core as mx

    out, dtype = [], "float16"
    for role in ("gate_proj", "up_proj", "down_proj"):
        base = f"model.layers.{layer}.mlp.{role}"
        if base + ".bias" in src.tensors:
            raise UnsupportedModelError(f"{base}: FFN biases are not supported by MoEfication")
        w = src.tensors.take(base + ".weight")
        if base in src.quant:
            q = src.quant[base]
            w = mx.dequantize(
                w, src.tensors.take(base + ".scales"), src.tensors.take(base + ".biases"), q.group_size, q.bits
            )
        elif w.dtype == mx.float32:
            dtype = "float32"
        out.append(np.array(w.astype(mx.float32)))
    return out[0], out[1], out[2], dtype


def moefy(
    source: str | None,
    out_dir: str,
    calib_text: str,
    n_experts: int = 16,
    top_k: int = 8,
    calib_tokens: int = 16384,
    block: int | None = None,
    valid_fraction: float = 0.1,
    epochs: int = 30,
    seed: int = 0,
    cache_dir: str = "",
    progress: bool = True,
    log=print,
) -> dict:
    """Derive the MoE model of `source` (a dense Llama-family GGUF / HF / mlx-community model; None:
    the default model) into `out_dir`, an HF-style directory that load() and convert() take; returns
    the report saved in its config (per layer: how well the router finds the best experts).

    Each layer's FFN neurons are split into `n_experts` experts of neurons that fire together on
    `calib_text` (its first `calib_tokens` tokens), and a linear router trained for `epochs` picks
    `top_k` of them per token (see moefication.py). The weights are the dense model's, so routing
    statistics are real; with top_k < n_experts the model is an approximation of the dense one.
    Needs torch (activations and router training run on the torch backend).

    Neurons move between experts in blocks of `block` (default: the group size the source quantized
    its down projection with, else 1). A quantized source's down groups run along the neurons, so
    experts made of whole groups keep the source's 4-bit numbers exactly representable: re-quantizing
    an expert to 4 bits (mixed_store.py) then loses nothing."""
    import mlx.core as mx
    from tqdm import tqdm

    if not 0 < top_k <= n_experts:
        raise ConfigError(f"top_k {top_k} is not in 1..n_experts ({n_experts})")
    if source is None:
        source = default_model_path()
    src = read_source(source)
    cfg = src.config
    if cfg["model_type"] not in ("llama", "mistral", "qwen2", "qwen3"):
        raise UnsupportedModelError(
            f"{source}: MoEfication needs a dense SwiGLU Llama-family model, not {cfg['model_type']!r}"
        )
    F, L = cfg["intermediate_size"], cfg["num_hidden_layers"]
    down_q = src.quant.get("model.layers.0.mlp.down_proj")
    block = block or (down_q.group_size if down_q else 1)
    if F % n_experts or (F // n_experts) % block:
        raise ConfigError(
            f"{F} FFN neurons do not split evenly into {n_experts} experts of whole {block}-neuron blocks"
        )
    with load(source, backend="torch", precision="f16", cache_dir=cache_dir, progress=progress) as eng:
        ids = eng.tokenizer.encode(calib_text[: calib_tokens * 8])[:calib_tokens]
        acts = collect(eng, ids, 256, calib_tokens, progress)
    n_fit = int(len(ids) * (1 - valid_fraction))
    tensors = {k: src.tensors.take(k) for k in src.tensors.names() if ".mlp." not in k}
    Fe = F // n_experts
    layers = []
    for i in tqdm(range(L), desc="moefying layers", unit="layer", disable=not progress):
        x, h = acts[i]
        gate, up, down, dtype = dense_ffn(src, i)
        blocks = h[:n_fit].astype(np.float32).reshape(len(h[:n_fit]), F // block, block).sum(2)  # [N, F/block]
        assign = np.repeat(balanced_clusters(blocks.T, n_experts, seed=seed + i), block)
        order = expert_order(assign, n_experts)
        scores = expert_contributions(x, gate, up, down, order, n_experts)
        router = train_router(x[:n_fit], scores[:n_fit], epochs=epochs, seed=seed + i)
        quality = router_quality(router, x[n_fit:], scores[n_fit:], top_k)
        layers.append(quality)
        if log:
            log(
                f"layer {i:2d}: router recall of the oracle top-{top_k} {quality['oracle_recall']:.3f}, output share "
                f"covered {quality['covered']:.3f} (oracle {quality['oracle_covered']:.3f})"
            )
        p = f"model.layers.{i}.mlp."
        tensors[p + "gate.weight"] = mx.array(router.astype(np.float32))
        for e in range(n_experts):
            rows = order[e * Fe : (e + 1) * Fe]
            for name, w in (("gate_proj", gate[rows]), ("up_proj", up[rows]), ("down_proj", down[:, rows])):
                tensors[f"{p}experts.{e}.{name}.weight"] = mx.array(np.ascontiguousarray(w).astype(dtype))
    report = {
        "derived_from": os.path.basename(os.path.abspath(source)),
        "method": "MoEfication: balanced k-means on co-activation, linear router trained on expert output norms",
        "calibration_tokens": len(ids),
        "block": block,
        "n_experts": n_experts,
        "top_k": top_k,
        "router": layers,
    }
    hf = {k: v for k, v in cfg.items() if k not in ("rope_scale", "extra")}
    hf.update(
        model_type="moefied_llama",
        hidden_act="silu",
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=Fe,
        norm_topk_prob=False,
        moefication=report,
    )
    hf.update(quantization=_quantization_config(src))
    with atomic_dir(out_dir) as tmp:  # (mlx writes the weights itself: atomic_dir fsyncs them before the rename)
        mx.save_safetensors(os.path.join(tmp, "model.safetensors"), tensors)
        src.save_tokenizer(tmp)
        write_json(os.path.join(tmp, "config.json"), hf, OutputError, in_folder=True)
    return report


def _quantization_config(src) -> dict | None:
    """mlx-community style: the commonest (bits, group) of the non-FFN linears, others per name."""
    from collections import Counter

    quant = {b: q for b, q in src.quant.items() if ".mlp." not in b}
    if not quant:
        return None
    (bits, group), _ = Counter((q.bits, q.group_size) for q in quant.values()).most_common(1)[0]
    out: dict = {"bits": bits, "group_size": group}
    for b, q in quant.items():
        if (q.bits, q.group_size) != (bits, group):
            out[b] = {"bits": q.bits, "group_size": q.group_size}
    return out
