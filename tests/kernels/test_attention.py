"""The CPU attention kernel (kernels/cpu/attention.cpp, run as the MLX primitive) against its plain-ops
reference on every code path this CPU can run: grouped-query heads, a causal prompt and decode steps,
per-row lengths and positions, keys in a pool of chunks read through a slot table, float16 keys,
head sizes that are not a multiple of the vector width, strided views of a cache, and a sliding window
(each query's last keys only)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.kernels import mlx_kernels
from mlx_flash.kernels.attention_ref import attention_ref
from mlx_flash.kernels.qmatmul import float_paths, use_isa

RUNNABLE = float_paths()  # the float arithmetic's loops


def _qkv(rng, B, Hq, Hkv, T, S, hd):
    q = rng.standard_normal((B, Hq, T, hd)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, S, hd)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, hd)).astype(np.float32)
    return q, k, v


def _close(y, ref):
    err = np.abs(np.array(y, dtype=np.float64) - ref).max()
    assert err < 2e-5 * max(1.0, np.abs(ref).max()), f"max error {err:.2e}"


@pytest.mark.parametrize(
    "shape",
    [
        (1, 9, 3, 1, 40, 64),
        (1, 9, 3, 37, 37, 64),
        (2, 8, 2, 5, 130, 128),
        (1, 4, 4, 70, 150, 80),
        (1, 6, 1, 17, 17, 24),
    ],
)
def test_equals_the_reference_on_every_path(shape, isa_restored):
    B, Hq, Hkv, T, S, hd = shape
    q, k, v = _qkv(np.random.default_rng(sum(shape)), *shape)
    ref = attention_ref(q, k, v, hd**-0.5)
    for isa in RUNNABLE:
        use_isa(isa)
        for threads in (1, 2):
            _close(mlx_kernels.attention(mx.array(q), mx.array(k), mx.array(v), hd**-0.5, threads), ref)


@pytest.mark.parametrize(
    "shape, window",
    [
        ((1, 8, 2, 300, 300, 64), 100),  # a prompt longer than the window: blocks before it skipped
        ((1, 8, 2, 40, 700, 64), 512),  # a chunk late in a long context
        ((1, 4, 1, 1, 1000, 256), 512),  # a decode step
        ((1, 4, 4, 20, 20, 32), 64),  # shorter than the window: every causal key
        ((1, 6, 3, 33, 90, 48), 1),  # each query its own key only
    ],
)
def test_a_window_equals_the_reference_on_every_path(shape, window, isa_restored):
    B, Hq, Hkv, T, S, hd = shape
    q, k, v = _qkv(np.random.default_rng(S + window), *shape)
    ref = attention_ref(q, k, v, hd**-0.5, window=window)
    for isa in RUNNABLE:
        use_isa(isa)
        for threads in (1, 2):
            _close(mlx_kernels.attention(mx.array(q), mx.array(k), mx.array(v), hd**-0.5, threads, window=window), ref)
    if T > 1 and S > window:  # the window is not the causal mask: a query differs from its unwindowed answer
        assert np.abs(attention_ref(q, k, v, hd**-0.5) - ref).max() > 1e-3


def test_refuses_a_negative_window():
    q, k, v = _qkv(np.random.default_rng(12), 1, 2, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="window"):
        mlx_kernels.attention(mx.array(q), mx.array(k), mx.array(v), 1.0, 1, window=-1)


def test_output_transposes_to_the_projection_input_without_a_copy():
    q, k, v = _qkv(np.random.default_rng(0), 1, 4, 2, 6, 6, 32)
    o = mlx_kernels.attention(mx.array(q), mx.array(k), mx.array(v), 0.2, 1)
    flat = o.transpose(0, 2, 1, 3).reshape(1, 6, 4 * 32)
    mx.eval(o, flat)
    assert np.asarray(flat).ctypes.data == np.asarray(o.transpose(0, 2, 1, 3)).ctypes.data
    _close(flat, attention_ref(q, k, v, 0.2).transpose(0, 2, 1, 3).reshape(1, 6, -1))


def test_per_row_lengths_and_positions():
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 3, 4, 2, 4, 50, 32)
    kv_len, q_pos = np.array([50, 9, 31], np.int32), np.array([46, 5, 0], np.int32)
    ref = attention_ref(q, k, v, 0.3, kv_len, q_pos)
    y = mlx_kernels.attention(mx.array(q), mx.array(k), mx.array(v), 0.3, 2, mx.array(kv_len), mx.array(q_pos))
    _close(y, ref)


def test_a_query_that_sees_no_key_gives_zeros():
    q, k, v = _qkv(np.random.default_rng(4), 1, 2, 2, 2, 8, 16)
    y = mlx_kernels.attention(
        mx.array(q),
        mx.array(k),
        mx.array(v),
        1.0,
        1,
        mx.array(np.array([0], np.int32)),
        mx.array(np.array([0], np.int32)),
    )
    assert np.array_equal(np.array(y), np.zeros_like(q))


def test_keys_in_a_pool_of_chunks_through_a_slot_table():
    rng = np.random.default_rng(5)
    B, Hq, Hkv, T, hd, bt = 2, 6, 3, 3, 64, 16
    pool_k = rng.standard_normal((7, Hkv, bt, hd)).astype(np.float32)
    pool_v = rng.standard_normal((7, Hkv, bt, hd)).astype(np.float32)
    table = np.array([[4, 0, 6], [2, 5, 1]], np.int32)
    kv_len, q_pos = np.array([40, 33], np.int32), np.array([37, 30], np.int32)
    q = rng.standard_normal((B, Hq, T, hd)).astype(np.float32)
    ref = attention_ref(q, pool_k, pool_v, 0.125, kv_len, q_pos, table)
    y = mlx_kernels.attention(
        mx.array(q), mx.array(pool_k), mx.array(pool_v), 0.125, 2, mx.array(kv_len), mx.array(q_pos), mx.array(table)
    )
    _close(y, ref)


def test_float16_keys_and_values_are_widened():
    q, k, v = _qkv(np.random.default_rng(6), 1, 4, 2, 3, 20, 32)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    y = mlx_kernels.attention(mx.array(q), mx.array(k16), mx.array(v16), 0.2, 1)
    _close(y, attention_ref(q, k16.astype(np.float32), v16.astype(np.float32), 0.2))


def test_reads_a_cache_through_a_strided_view():
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 1, 6, 2, 1, 256, 64)
    kv = mx.array(k)[:, :, :77, :], mx.array(v)[:, :, :77, :]  # a cache buffer holding 77 tokens
    _close(mlx_kernels.attention(mx.array(q), *kv, 0.125, 2), attention_ref(q, k[:, :, :77], v[:, :, :77], 0.125))


def test_refuses_shapes_that_do_not_fit():
    q, k, v = _qkv(np.random.default_rng(8), 1, 5, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="does not fit"):
        mlx_kernels.attention(mx.array(q), mx.array(k), mx.array(v), 1.0, 1)
    q, k, v = _qkv(np.random.default_rng(8), 1, 4, 2, 6, 4, 8)
    with pytest.raises(ValueError, match="fewer keys than queries"):
        mlx_kernels.attention(mx.array(q), mx.array(k), mx.array(v), 1.0, 1)
