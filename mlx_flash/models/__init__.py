"""Model graphs, one file per architecture family, written once against the backend op set.

A model module is found by its HF `model_type` with importlib (`model_module`; mistral.py, qwen2.py
and qwen3.py reuse llama.py's graph, gemma3.py gemma3_text.py's; mixtral.py, qwen2_moe.py, qwen3_moe.py and olmoe.py reuse
moe.py's). Each module provides:
  normalize_config(hf_config, where) -> dict     the store's config for this architecture
  canonical_tensors(tensors, config, where)     HF checkpoint names -> canonical names
  ffn_parts(config, layer) -> dict               role ("gate", "up", "down") -> linear name
  expert_parts(config, layer) -> [dict]         MoE only: ffn_parts of each expert, in expert order
  GATE_ACTIVATION, ffn_hidden(ops, args, fw, x)  gated dense families: the gate's activation
                                                 (ffn_source.GateActivation) and the FFN's activations
  ModelArgs.from_dict(config)
  build(ops, args, get) -> weights               resident (non-FFN) weights as backend objects
  embed(ops, args, weights, tokens, caches) -> h              the residual stream [B, T, D]
  block(ops, args, weights["layers"][i], i, h, cache, ffn) -> h   layer i
  head(ops, args, weights, h, all_logits) -> logits
  forward(ops, args, weights, tokens, caches, ffn, all_logits) -> logits   embed, every block, head
The pieces let the throughput mode (mlx_flash/offload) run one layer over many micro-batches before
the next; forward is the same graph in one call.
"""

import importlib

from ..errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "opt", "mixtral", "qwen2_moe",
                         "qwen3_moe", "olmoe", "moefied_llama")


def model_module(model_type: str, where: str):
    """The architecture module for an HF model_type (one file per family, found by importlib)."""
    name = str(model_type).replace("-", "_")
    if not name.isidentifier():
        raise UnsupportedModelError(f"{where}: model_type {model_type!r} is not supported")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        ) from None
