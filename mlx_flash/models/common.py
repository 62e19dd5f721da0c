"""Pieces shared by the architecture modules."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields


class ArgsFromDict:
    @classmethod
    def from_dict(cls, d: dict):
        """Build from a store config, ignoring keys this architecture does not use."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp's GGUF files of a graph part from the tensor names and metadata all families
    share (convert/gguf_source.py holds those and asks the graph's module, its GGUF, for the rest)."""

    # blk.<i>.<role> -> the name under model.layers.<i>., where the graph's differs from the shared one
    layer_names: Mapping[str, str] = field(default_factory=dict)
    norm_plus_one: bool = False  # norm weights stored as 1 + w: read back as w, as transformers does
    # HF config fields llama.cpp's graph assumes and the metadata leaves out, from the config read so far
    config: Callable[[dict], dict] | None = None


def linear(ops, x, w):
    """ops.linear, also for a tuple of weights that could not be fused into one (they differ in
    quantization): their outputs are concatenated, which is what the fused matmul computes."""
    if isinstance(w, tuple):
        return ops.concatenate([ops.linear(x, part) for part in w], axis=-1)
    return ops.linear(x, w)


def gated_hidden(ops, act, gate_up, x):
    """A gated FFN's activations act(gate) * up [.., F] from gate and up rows fused [2F, D]; `act`
    is the family's ffn_source.GateActivation."""
    if isinstance(gate_up, tuple) and len(gate_up) == 2:  # gate and up as two products: no concatenation
        return ops.gated(act, ops.linear(x, gate_up[0]), ops.linear(x, gate_up[1]))
    both = linear(ops, x, gate_up)
    n = both.shape[-1] // 2
    gate, up = ops.split(both, [n, n])
    return ops.gated(act, gate, up)


def gated_mlp(ops, act, fw, x):
    """A gated FFN of x from bundle-form weights (an ffn_source.FFNWeights): down maps the F activations
    act(gate) * up to D (its stored orientation: weights.neuron_arrays). A sparse FFN source may zero
    neurons with fw.mask, may give down for some neurons only (fw.rows: their ids, in down's order)
    while gate|up cover all of them, may hand over activations it already computed from x (fw.hidden),
    or hand the whole FFN to the backend's sparse kernel (fw.sparse). Whole weights take one fused
    call where the backend has one for them (ops.gated_ffn), else the pieces."""
    if fw.sparse is not None:
        return ops.sparse_ffn(fw.sparse, x, act)
    if fw.hidden is None and fw.rows is None and fw.mask is None:
        y = ops.gated_ffn(act, fw.gate_up, fw.down, x)
        if y is not None:
            return y
    hidden = fw.hidden if fw.hidden is not None else gated_hidden(ops, act, fw.gate_up, x)
    if fw.rows is not None:
        hidden = ops.take(hidden, fw.rows)
    if fw.mask is not None:
        hidden = hidden * fw.mask
    return ops.linear(hidden, fw.down)
