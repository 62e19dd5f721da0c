"""Store bytes to backend weights: a group of linears the model fuses (q, k, v) is stored back to back
by the converter, so the fused weight the kernel computes on is a view of the bytes read."""

import os

import numpy as np
import pytest

import mlx_flash
import tiny_models
from mlx_flash.convert import convert
from mlx_flash.backends import owner
from mlx_flash.weights import join_rows


def test_join_rows_views_back_to_back_arrays_and_copies_others():
    buf = np.arange(64, dtype=np.uint8)
    a, b = buf[:16].view(np.uint32).reshape(2, 2), buf[16:32].view(np.uint32).reshape(2, 2)
    joined = join_rows([a, b])
    assert np.shares_memory(joined, buf) and np.array_equal(joined, np.concatenate([a, b]))
    c = buf[40:48].view(np.uint32).reshape(1, 2)  # a gap before it: joined by a copy
    assert not np.shares_memory(join_rows([a, c]), buf)
    rows = np.arange(64, dtype=np.uint8).reshape(4, 16)  # a buffer as rows (MLX's past 1 GiB): views still
    flat = rows.reshape(-1)
    a, b = flat[:16].view(np.uint32).reshape(2, 2), flat[16:32].view(np.uint32).reshape(2, 2)
    assert np.shares_memory(join_rows([a, b]), rows)
    assert np.array_equal(join_rows([a, c]), np.concatenate([a, c]))


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_fused_qkv_is_a_view_of_the_resident_file(tmp_path, backend):
    pytest.importorskip("torch")
    tiny_models.build("llama", str(tmp_path / "hf"))
    tiny_models.quantize_dir(str(tmp_path / "hf"), str(tmp_path / "q"))
    store = convert(str(tmp_path / "q"), str(tmp_path / "store"), progress=False)
    size = os.path.getsize(os.path.join(store, "resident.safetensors"))
    with mlx_flash.load(store, backend=backend, progress=False) as e:
        for part in e.weights["layers"][0]["qkv"].matrix.arrays:
            assert owner(part).nbytes == size  # cut from the one buffer the file was read into
