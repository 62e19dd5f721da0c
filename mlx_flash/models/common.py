"""Pieces shared by the architecture modules."""

from dataclasses import fields


class ArgsFromDict:
    @classmethod
    def from_dict(cls, d: dict):
        """Build from a store config, ignoring keys this architecture does not use."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


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
