"""Model graphs, one file per architecture family, written once against the backend op set.

MODEL_TYPES is the one table of supported HF `model_type`s: each names the module whose graph runs
it (mistral, qwen2 and qwen3 run llama.py's graph; gemma3, a multimodal config holding a text model,
gemma3_text.py's on its text weights; mixtral, qwen2_moe, qwen3_moe, olmoe and moefied_llama moe.py's,
which tells them apart by model_type in its normalize_config), and what llama.cpp's GGUF files of
that type say that the graph's other types' do not (their architecture name, whether their experts
are read, config fields they imply). `model_module(model_type, where)` imports the module.
Each module provides:
  normalize_config(hf_config, where) -> dict     the store's config for this architecture
  canonical_tensors(tensors, config, where)     HF checkpoint names -> canonical names
  ffn_parts(config, layer) -> dict               role ("gate", "up", "down") -> linear name
  expert_parts(config, layer) -> [dict]         MoE only: ffn_parts of each expert, in expert order
  GATE_ACTIVATION, ffn_hidden(ops, args, fw, x)  gated dense families: the gate's activation
                                                 (ffn_source.GateActivation) and the FFN's activations
  GGUF                                           common.GGUFLayout: how llama.cpp's GGUFs of the graph
                                                 name and store its tensors (read by convert/)
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
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class ModelType:
    """One supported model_type: the module that runs it and its GGUF facts that depend on the
    architecture's name rather than on the graph (those of the graph are the module's GGUF)."""

    module: str  # models/<module>.py implements the graph
    gguf_arch: str = ""  # llama.cpp's general.architecture for this type, where it is not the model_type
    gguf_experts: bool = False  # its GGUFs' expert stacks are read (llama.cpp's MoE layout of this arch)
    # HF config fields its GGUFs imply without stating them in their metadata
    gguf_config: Mapping[str, object] = field(default_factory=dict)
    # every layer attends causally over the whole context: what a cache that attends for the graph
    # takes (compressed KV tiers: models/kv_tiers.CodedTieredKV); sliding-window layers mask otherwise
    causal_attention: bool = True


# llama.cpp permutes the q/k rows of these for the interleaved ("traditional") RoPE layout; qwen2/qwen3
# (and qwen3moe) are stored as HF has them and rotated in halves (llama.cpp's NEOX rope).
_INTERLEAVED_ROPE = {"rope_traditional": True}

MODEL_TYPES: dict[str, ModelType] = {
    "llama": ModelType("llama", gguf_config=_INTERLEAVED_ROPE),
    "mistral": ModelType("llama", gguf_config=_INTERLEAVED_ROPE),
    "qwen2": ModelType("llama"),
    "qwen3": ModelType("llama"),
    "gemma3_text": ModelType("gemma3_text", causal_attention=False),
    "gemma3": ModelType("gemma3_text", causal_attention=False),
    "opt": ModelType("opt"),
    "mixtral": ModelType("moe"),
    "qwen2_moe": ModelType("moe"),
    # llama.cpp's qwen3moe graph always renormalizes the top-k router weights and has no shared expert
    "qwen3_moe": ModelType("moe", gguf_arch="qwen3moe", gguf_experts=True, gguf_config={"norm_topk_prob": True}),
    "olmoe": ModelType("moe"),
    "moefied_llama": ModelType("moe"),  # a dense Llama-family model split into experts (tools/moefy.py)
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)
# The GGUF architectures whose mixture-of-experts files are read (named as llama.cpp names them).
GGUF_MOE_ARCHS = tuple(t.gguf_arch or name for name, t in MODEL_TYPES.items() if t.gguf_experts)
_GGUF_MODEL_TYPES = {t.gguf_arch: name for name, t in MODEL_TYPES.items() if t.gguf_arch}


def gguf_model_type(arch: str) -> str:
    """The model_type of a GGUF's general.architecture (the same name unless the table says otherwise)."""
    return _GGUF_MODEL_TYPES.get(arch, arch)


def model_entry(model_type: str, where: str) -> ModelType:
    """The table's entry for an HF model_type ("-" read as "_")."""
    entry = MODEL_TYPES.get(str(model_type).replace("-", "_"))
    if entry is None:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return entry


def model_module(model_type: str, where: str):
    """The module whose graph runs an HF model_type (MODEL_TYPES names it)."""
    return importlib.import_module(f"{__name__}.{model_entry(model_type, where).module}")
