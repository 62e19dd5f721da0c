"""What `backend="auto"` (the default) means on this machine, decided once at load without importing
either framework: MLX on Apple silicon (its Metal GPU is the fast path there); elsewhere torch when it
is installed (CUDA when a GPU is present; on a CPU it runs the same kernels with less overhead per op
than MLX's CPU build), else MLX on the CPU, saying what torch would give. A backend asked for by name
is taken as it is."""

from __future__ import annotations

import importlib.util
import platform
import sys

TORCH_CPU_WHEEL = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def choose_backend(asked: str, device: str | None = None) -> tuple[str, str]:
    """(backend name, why) for `asked` ("auto", "mlx" or "torch") and the device asked for, if any."""
    if asked != "auto":
        return asked, "asked for"
    if device == "gpu":
        return "mlx", "auto: device gpu is MLX's"
    if device is not None and device.startswith("cuda"):
        return "torch", f"auto: device {device} is torch's"
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "mlx", "auto: Apple silicon, MLX on its GPU"
    if importlib.util.find_spec("torch") is not None:
        return "torch", "auto: torch is installed; CUDA when a GPU is present, else its CPU path"
    return "mlx", (
        "auto: torch is not installed, so MLX on the CPU; torch's CPU path decodes and prefills faster "
        f"here (docs/results/backends.md): {TORCH_CPU_WHEEL}"
    )
