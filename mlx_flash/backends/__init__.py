"""Backends: one op set with MLX names and semantics, implemented by MLX (primary) and torch.

Model graphs are written once against these ops (see models/); a backend is chosen per engine. The op
set is declared as the Protocol `Ops` (backends/ops.py; `LazyOps` adds a lazy backend's slot turns).
"""

from __future__ import annotations

import importlib
import os

from ..errors import ConfigError
from ..ffn_source import GateActivation
from ..kernels.blockmatmul import BlockMatrix
from .ops import LazyOps as LazyOps, Ops  # re-exported: the declared op set

BACKENDS = ("mlx", "torch")


def get_backend(name: str = "mlx", **kwargs) -> Ops:
    """Instantiate the ops object of backend `name` ("mlx" or "torch"): an `Ops` (backends/ops.py)."""
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is unknown (choose one of: {', '.join(BACKENDS)})")
    mod = importlib.import_module(f"mlx_flash.backends.{name}")
    device = kwargs.get("device")
    # Checked here: the frameworks refuse a bad device with an assert or errors that name no option.
    if device is not None and name == "mlx":
        _check_mlx_device(device)
    elif device is not None:
        _check_torch_device(mod.torch, device)
    cls = mod.MLXOps if name == "mlx" else mod.TorchOps
    return cls(**kwargs)


def _check_mlx_device(device) -> None:
    if device not in ("cpu", "gpu"):
        raise ConfigError(f"device {device!r} is unknown for backend mlx (choose cpu or gpu)")
    import mlx.core as mx

    if device == "gpu" and not mx.is_available(mx.gpu):
        raise ConfigError(
            f"device 'gpu': MLX {mx.__version__} has no GPU here (Metal on a Mac, or MLX's CUDA "
            "build on an NVIDIA GPU); use device cpu"
        )


def _check_torch_device(torch, device) -> None:
    """cpu, cuda or cuda:N, where torch has that CUDA device (torch None: not installed, which
    TorchOps reports)."""
    if torch is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is unknown for backend torch (choose cpu, cuda or cuda:N)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: torch {torch.__version__} sees no CUDA device here; use device cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")


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


def covered_bytes(ranges) -> int:
    """Bytes covered by (start, nbytes) memory ranges, overlaps counted once: a tensor that views part
    of a buffer another leaf owns (torch.from_numpy of a slice) adds nothing."""
    total, end = 0, None
    for start, n in sorted(ranges):
        if end is None or start >= end:
            total, end = total + n, start + n
        elif start + n > end:
            total, end = total + start + n - end, start + n
    return total


def walk(tree, is_leaf):
    """The leaves of a weights tree (dicts, lists, tuples and dataclasses, walked into unless
    `is_leaf` says a node is a leaf)."""
    import dataclasses

    if is_leaf(tree):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from walk(v, is_leaf)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from walk(v, is_leaf)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            yield from walk(getattr(tree, f.name), is_leaf)


def leaves(tree):
    """Every array-like leaf of a weights tree (dicts, lists, tuples and dataclasses such as Weight)."""
    import dataclasses

    def is_array(t):
        return not isinstance(t, (dict, list, tuple)) and not dataclasses.is_dataclass(t) and hasattr(t, "shape")

    return walk(tree, is_array)


def block_matrix(raw, quant, transposed: bool):
    """The CPU block kernel's view of a stored GGUF block-type weight (rows of whole blocks, as the
    store holds them: never dequantized as a whole), shared by both backends."""

    if transposed:
        raise ConfigError(f"{quant.kind} weights are stored with rows as outputs; a transposed one cannot be built")
    return BlockMatrix(raw, quant.kind)


def fused_ffn_weights(act, gate_up, down, takes):
    """(gate, up or None, down) when a gated FFN over these weights is one kernel call: SwiGLU, gate|up
    one weight or two (gate, up), and every weight one the backend's kernel `takes`; else None (the
    graph composes the pieces). Both backends' gated_ffn ask this."""
    parts = gate_up if isinstance(gate_up, tuple) else (gate_up,)
    if act is not GateActivation.SILU or len(parts) > 2 or not all(takes(w) for w in (*parts, down)):
        return None
    return parts[0], parts[1] if len(parts) == 2 else None, down


def expert_operators(act, fw, operator) -> tuple | None:
    """An expert's (gate, up or None, down) kernel operators when its gated FFN is one kernel's (see
    fused_ffn_weights; `operator(w)`: the backend's operator over a weight's stored bytes, or None),
    else None."""
    found = fused_ffn_weights(act, fw.gate_up, fw.down, lambda w: operator(w) is not None and w.bias is None)
    return None if found is None else tuple(None if w is None else operator(w) for w in found)


def slab_operators(cache: dict, call, make) -> tuple:
    """The operators `make(matrix)` builds over a sparse call's slab (gate, up, down), kept in `cache`
    per slab: a neuron cache's rows stay where they are, so a step builds none."""
    slab = call.slab
    key = (slab.ctypes.data, slab.shape)
    if key not in cache:
        if len(cache) > 256:  # slabs come and go (whole layers read into transient buffers)
            cache.clear()
        cache[key] = (slab, tuple(make(m) for m in call.kernel.matrices(slab)))  # the slab kept alive
    return cache[key][1]
