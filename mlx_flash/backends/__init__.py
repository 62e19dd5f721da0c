"""Backends: one op set with MLX names and semantics, implemented by MLX (primary) and torch.

Model graphs are written once against these ops (see models/); a backend is chosen per engine.
"""

from __future__ import annotations

import importlib
import os

from ..errors import ConfigError

BACKENDS = ("mlx", "torch")


def get_backend(name: str = "mlx", **kwargs):
    """Instantiate the ops object of backend `name` ("mlx" or "torch")."""
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is unknown (choose one of: {', '.join(BACKENDS)})")
    mod = importlib.import_module(f"mlx_flash.backends.{name}")
    cls = mod.MLXOps if name == "mlx" else mod.TorchOps
    return cls(**kwargs)


def cpu_threads() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one (taskset, a cgroup cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def owner(a):
    """The numpy array that owns the memory a numpy view lies in (itself when it owns it): what held
    bytes count once, and what a run of back-to-back views can be cut from again."""
    import numpy as np

    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


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
