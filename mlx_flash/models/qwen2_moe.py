"""qwen2_moe uses the mixture-of-experts graph (see moe.py); this module exists so importlib finds it by model_type."""

from .moe import ModelArgs, build, canonical_tensors, expert_parts, ffn_parts, forward, normalize_config

__all__ = ["ModelArgs", "build", "canonical_tensors", "expert_parts", "ffn_parts", "forward", "normalize_config"]
