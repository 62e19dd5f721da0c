"""ops.sdpa_slots (backends/slot_attention.py): rows whose keys and values lie in a pool of chunks,
named by a slot table, attended where they lie. Each backend's kernel path and the plain-ops
gathered path against the float64 reference (kernels/attention_ref.py), on rows of different
lengths in scattered slots, one new query each (a decode step) and several (a prefill chunk)."""

import numpy as np
import pytest

from mlx_flash.backends import get_backend
from mlx_flash.backends.slot_attention import block_shape, gathered_sdpa, table_rows
from mlx_flash.kernels.attention_ref import attention_ref

pytest.importorskip("torch")

C, H, HQ, HD, SLOTS = 4, 2, 6, 8, 12


def case(T: int, seed: int = 0):
    """A pool layer [H, SLOTS * C, hd], three rows of 9, 2 and 5 keys in scattered slots (the table's
    padding points at slot 0), each row's last T keys its new ones."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((H, SLOTS * C, HD)).astype(np.float32)
    v = rng.standard_normal((H, SLOTS * C, HD)).astype(np.float32)
    table = np.array([[7, 2, 10], [5, 0, 0], [11, 3, 0]], np.int32)
    kv_len = np.array([9, 2, 5], np.int32)
    q = rng.standard_normal((3, HQ, T, HD)).astype(np.float32)
    return q, k, v, table, kv_len, kv_len - np.int32(T)


def reference(q, k, v, table, kv_len, q_pos):
    shape, axes = block_shape(k.shape, C)
    pools = [x.reshape(shape).transpose(axes) for x in (k, v)]
    return attention_ref(q, *pools, 0.3, kv_len, q_pos, table)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("T", [1, 2])
def test_the_kernel_and_the_gathered_path_equal_the_reference(backend, T):
    ops = get_backend(backend)
    q, k, v, table, kv_len, q_pos = case(T)
    want = reference(q, k, v, table, kv_len, q_pos)
    qa, ka, va = ops.array(q), ops.array(k), ops.array(v)
    kernel = ops.to_numpy(ops.sdpa_slots(qa, ka, va, 0.3, C, table, kv_len, q_pos))
    gathered = ops.to_numpy(gathered_sdpa(ops, qa, ka, va, 0.3, C, table, kv_len, q_pos))
    np.testing.assert_allclose(kernel, want, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(gathered, want, atol=2e-6, rtol=1e-5)


def test_the_slots_give_the_rows_in_order():
    table = np.array([[3, 1], [2, 0]], np.int32)
    assert table_rows(table, 4, 6).tolist() == [[12, 13, 14, 15, 4, 5], [8, 9, 10, 11, 0, 1]]


def test_a_pool_of_part_chunks_is_refused():
    with pytest.raises(ValueError, match="whole chunks"):
        block_shape((2, 10, 8), 4)
