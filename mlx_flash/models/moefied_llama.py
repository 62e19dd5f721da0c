"""A dense Llama-family model split into experts by `tools/moefy.py` (MoEfication, see
moe/moefication.py): Llama attention, the MoE graph of moe.py with a top-K router whose chosen
experts add up unweighted, as the pieces of the dense FFN they are."""

from .moe import ModelArgs, block, build, canonical_tensors, embed, expert_parts, ffn_parts, forward, head
from .moe import normalize_config as _moe_config

__all__ = ["ModelArgs", "block", "build", "canonical_tensors", "embed", "expert_parts", "ffn_parts", "forward", "head", "normalize_config"]


def normalize_config(hf: dict, where: str) -> dict:
    cfg = _moe_config(hf, where)
    cfg["unit_router_weights"] = True
    return cfg
