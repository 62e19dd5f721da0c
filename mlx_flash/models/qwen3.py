"""qwen3 uses the Llama-family graph (see llama.py); this module exists so importlib finds it by model_type."""

from .llama import ModelArgs, build, canonical_tensors, ffn_parts, forward, normalize_config

__all__ = ["ModelArgs", "build", "canonical_tensors", "ffn_parts", "forward", "normalize_config"]
