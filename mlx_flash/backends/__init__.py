"""Backends: one op set with MLX names and semantics, implemented by MLX (primary) and torch.

Model graphs are written once against these ops (see models/); a backend is chosen per engine.
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError

BACKENDS = ("mlx", "torch")


def get_backend(name: str = "mlx", **kwargs):
    """Instantiate the ops object of backend `name` ("mlx" or "torch")."""
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is unknown (choose one of: {', '.join(BACKENDS)})")
    mod = importlib.import_module(f"mlx_flash.backends.{name}")
    cls = mod.MLXOps if name == "mlx" else mod.TorchOps
    return cls(**kwargs)


def leaves(tree):
    """Every array-like leaf of a weights tree (dicts, lists, tuples and dataclasses such as Weight)."""
    import dataclasses

    if isinstance(tree, dict):
        for v in tree.values():
            yield from leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from leaves(v)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            yield from leaves(getattr(tree, f.name))
    elif tree is not None and hasattr(tree, "shape"):
        yield tree
