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
