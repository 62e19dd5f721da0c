"""Synthetic Qwen3-MoE GGUFs shared by the MoE tests (written once a session): the small shape with
block-kind experts (llama.cpp's Q4_K_M mix) and with Q4_1 experts."""

import pytest

from mlx_flash.convert import convert
from moe_files import write_moe_gguf


@pytest.fixture(scope="session")
def moe_gguf(tmp_path_factory):
    return write_moe_gguf(str(tmp_path_factory.mktemp("moekq") / "moe-q4_k_m.gguf"), "Q4_K_M")


@pytest.fixture(scope="session")
def moe_store(moe_gguf, tmp_path_factory):
    return convert(moe_gguf, str(tmp_path_factory.mktemp("moekq") / "store"), progress=False)
