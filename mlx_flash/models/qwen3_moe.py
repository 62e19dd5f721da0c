"""qwen3_moe uses the mixture-of-experts graph (see moe.py); this module exists so importlib finds it by model_type."""

from .moe import ModelArgs, block, build, canonical_tensors, embed, expert_parts, ffn_parts, forward, head, normalize_config

__all__ = ["ModelArgs", "block", "build", "canonical_tensors", "embed", "expert_parts", "ffn_parts", "forward", "head", "normalize_config"]
