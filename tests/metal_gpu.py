"""Whether a Metal GPU is here, for the Metal kernel tests: their bodies always run on the CPU through
the MSL shim (kernels/metal_cpu.py); on Apple silicon they also run through MLX."""

import pytest


def metal_available() -> bool:
    try:
        import mlx.core as mx
    except ImportError:
        return False
    return mx.metal.is_available()


def needs_metal(what: str):
    """A skip mark naming what ran instead."""
    return pytest.mark.skipif(
        not metal_available(),
        reason="no Metal GPU here (mx.metal.is_available() is false); "
        f"{what} ran on the CPU through the MSL shim above",
    )


def require_shim() -> None:
    """Skip (naming why) where the shim cannot compile bodies: no C++ compiler."""
    from mlx_flash.kernels import metal_cpu

    try:
        metal_cpu.compiler()
    except metal_cpu.ShimUnavailable as e:
        pytest.skip(str(e))
