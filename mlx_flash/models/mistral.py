"""mistral uses the Llama-family graph (see llama.py); this module exists so importlib finds it by model_type."""

from .llama import (GATE_ACTIVATION, ModelArgs, block, build, canonical_tensors, embed, ffn_hidden, ffn_parts, forward,
                    head, normalize_config)

__all__ = ["GATE_ACTIVATION", "ModelArgs", "block", "build", "canonical_tensors", "embed", "ffn_hidden", "ffn_parts",
           "forward", "head", "normalize_config"]
