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
