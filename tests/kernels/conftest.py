"""Shared by the kernel tests."""

import pytest

from mlx_flash.kernels.qmatmul import cpu_isa, use_isa


@pytest.fixture
def isa_restored():
    before = cpu_isa()
    yield
    use_isa(before)
