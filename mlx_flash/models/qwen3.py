"""qwen3 uses the Llama-family graph (see llama.py); this module exists so importlib finds it by model_type."""

from .llama import ModelArgs, block, build, canonical_tensors, embed, ffn_parts, forward, head, normalize_config

__all__ = ["ModelArgs", "block", "build", "canonical_tensors", "embed", "ffn_parts", "forward", "head", "normalize_config"]
