"""gemma3 (a multimodal config holding a text model) runs the Gemma 3 text graph (gemma3_text.py) on
its text weights; this module exists so importlib finds it by model_type."""

from .gemma3_text import (GATE_ACTIVATION, ModelArgs, block, build, canonical_tensors, embed, ffn_hidden, ffn_parts,
                          forward, head, normalize_config)

__all__ = ["GATE_ACTIVATION", "ModelArgs", "block", "build", "canonical_tensors", "embed", "ffn_hidden", "ffn_parts",
           "forward", "head", "normalize_config"]
