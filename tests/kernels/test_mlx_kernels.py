"""The CPU kernels as MLX primitives (kernels/mlx_kernels.py over the _mlx_kernels extension): each
operation equals the numpy path of the same kernel, or its plain-ops reference; weights are read in
place (from MLX memory where MLX allocated it, from numpy memory without a copy), products over
memory the I/O code may reuse are evaluated when built, and a KV cache append writes in place."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.kernels import mlx_kernels
from mlx_flash.kernels.blockmatmul import BlockMatrix
from mlx_flash.kernels.gguf_blocks_ref import dequantize
from mlx_flash.kernels.pointwise_ref import rms_norm_ref, rope_ref, silu_mul_ref
from mlx_flash.kernels.qmatmul import StoredMatrix
from mlx_flash.kernels.qmatmul_ref import dequantize as dequantize_affine

from kernel_vectors import lay_out, quantized, random_bytes


def _x(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("tokens", [1, 7])
def test_a_product_equals_the_numpy_path_bit_for_bit(bits, transposed, tokens):
    rng = np.random.default_rng(bits + tokens)
    rows, cols = (192, 256) if transposed else (256, 192)
    _, words, scales, biases = quantized(rng, rows, cols, bits, 32)
    m = StoredMatrix(words, scales, biases, bits, 32, transposed)
    x = _x(rng, tokens, m.k_in)
    y = mlx_kernels.GraphMatrix(m, 2)(mx.array(x).reshape(1, tokens, -1))
    assert y.shape == (1, tokens, m.n_out)
    assert np.array_equal(np.array(y).reshape(tokens, -1), m(x, 2))


@pytest.mark.parametrize("as_groups", [False, True])
def test_laid_out_and_sparse_products_equal_the_numpy_path(as_groups):
    rng = np.random.default_rng(11)
    _, words, scales, biases = quantized(rng, 96, 256, 4, 32)
    m = StoredMatrix(*lay_out(words, scales, biases, 4, 32, 32, as_groups), 4, 32)
    g = mlx_kernels.GraphMatrix(m, 2)
    x = _x(rng, 3, m.k_in)
    assert np.array_equal(np.array(g(mx.array(x))), m(x, 2))
    ids = np.array([2, 0], np.int32) if not as_groups else np.array([5, 1, 7], np.int32)
    xs = x if not as_groups else _x(rng, 3, len(ids) * 32)
    want = m.sparse(xs, ids, 2)
    got = g.sparse(mx.array(xs), mx.array(ids), len(ids))
    assert np.array_equal(np.array(got), want)


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
def test_block_products_and_rows(kind):
    raw = random_bytes(kind, 40, 512, seed=2)
    m = BlockMatrix(raw, kind)
    x = _x(np.random.default_rng(0), 2, 512)
    assert np.array_equal(np.array(mlx_kernels.GraphMatrix(m, 2)(mx.array(x))), m(x, 2))
    ids = np.array([[3, 39, 0]], np.int32)
    rows = np.array(mlx_kernels.GraphMatrix(m, 1).rows(mx.array(ids)))
    assert rows.shape == (1, 3, 512)
    assert np.array_equal(rows[0], dequantize(raw[ids[0]], kind))


def test_affine_rows_equal_the_numpy_dequantization():
    rng = np.random.default_rng(4)
    _, words, scales, biases = quantized(rng, 50, 128, 4, 32)
    m = StoredMatrix(words, scales, biases, 4, 32)
    ids = np.array([7, 49, 7, 0], np.int32)
    got = np.array(mlx_kernels.GraphMatrix(m, 1).rows(mx.array(ids)))
    assert np.array_equal(
        got, dequantize_affine(words[ids], scales[ids], biases[ids], 4, 32).astype(np.float32)
    )  # one rounding


def test_an_id_outside_the_matrix_gives_zeros_not_a_read_outside():
    rng = np.random.default_rng(5)
    _, words, scales, biases = quantized(rng, 8, 64, 8, 32)
    got = np.array(
        mlx_kernels.GraphMatrix(StoredMatrix(words, scales, biases, 8, 32), 1).rows(mx.array(np.array([8, -1])))
    )
    assert not got.any()


def test_weights_in_mlx_memory_are_read_where_they_lie():
    rng = np.random.default_rng(6)
    _, words, scales, biases = quantized(rng, 64, 128, 4, 32)
    buf = mlx_kernels.framework_buffer(words.nbytes + scales.nbytes + biases.nbytes)
    assert buf.ctypes.data % mlx_kernels.PAGE == 0 and buf.flags.writeable
    w = buf[: words.nbytes].view(np.uint32).reshape(words.shape)
    s = buf[words.nbytes : words.nbytes + scales.nbytes].view(np.float16).reshape(scales.shape)
    b = buf[words.nbytes + scales.nbytes :].view(np.float16).reshape(biases.shape)
    w[...], s[...], b[...] = words, scales, biases  # what a read into the buffer does
    g = mlx_kernels.GraphMatrix(StoredMatrix(w, s, b, 4, 32), 1)
    assert not g.external and mlx_kernels.buffer_of(w)[0] is g.buffer
    ext = mlx_kernels.extension()
    ext.record_inputs(True)
    try:
        mx.eval(g(mx.array(_x(rng, 1, 128))))
        assert ext.recorded_inputs() == [("StoredMatmul", w.ctypes.data)]
    finally:
        ext.record_inputs(False)


def test_numpy_memory_is_wrapped_without_a_copy_and_evaluated_at_once():
    rng = np.random.default_rng(7)
    _, words, scales, biases = quantized(rng, 64, 128, 4, 32)
    buf = np.empty(words.nbytes + scales.nbytes + biases.nbytes, np.uint8)  # e.g. a reused read buffer
    w = buf[: words.nbytes].view(np.uint32).reshape(words.shape)
    s = buf[words.nbytes : words.nbytes + scales.nbytes].view(np.float16).reshape(scales.shape)
    b = buf[words.nbytes + scales.nbytes :].view(np.float16).reshape(biases.shape)
    w[...], s[...], b[...] = words, scales, biases
    m = StoredMatrix(w, s, b, 4, 32)
    g = mlx_kernels.GraphMatrix(m, 1)
    assert g.external
    x = _x(rng, 1, 128)
    y = g(mx.array(x))
    w[...] = 0  # the buffer refilled right after the product was built: the product already ran
    assert np.array_equal(np.array(y), StoredMatrix(words, scales, biases, 4, 32)(x))


def test_pointwise_operations_equal_their_references():
    rng = np.random.default_rng(8)
    x, w = _x(rng, 2, 3, 576), _x(rng, 576)
    assert (
        np.abs(np.array(mlx_kernels.rms_norm(mx.array(x), mx.array(w), 1e-5)) - rms_norm_ref(x, w, 1e-5)).max() < 1e-5
    )
    g, u = _x(rng, 3, 100), _x(rng, 3, 100)
    assert np.abs(np.array(mlx_kernels.silu_mul(mx.array(g), mx.array(u))) - silu_mul_ref(g, u)).max() < 1e-5
    both = mx.array(_x(rng, 2, 3, 200))  # the halves of a fused product: views with a row stride of 200
    got = mlx_kernels.silu_mul(both[..., :100], both[..., 100:])
    assert np.abs(np.array(got) - silu_mul_ref(np.array(both)[..., :100], np.array(both)[..., 100:])).max() < 1e-5
    for traditional in (True, False):
        q = _x(rng, 2, 3, 5, 64)
        inv = (1.0 / 10000 ** (np.arange(0, 48, 2) / 48)).astype(np.float32)
        pos = np.array([7, 100], np.int32)
        got = mlx_kernels.rope(mx.array(q), mx.array(inv), mx.array(pos), 48, traditional, 0.5)
        assert np.abs(np.array(got) - rope_ref(q, inv, pos, 48, traditional, 0.5)).max() < 2e-4


def test_rope_equals_mlx_fast_rope():
    q = _x(np.random.default_rng(9), 1, 9, 4, 64)
    inv = mx.array((1.0 / 1e5 ** (np.arange(0, 64, 2) / 64)).astype(np.float32))
    for traditional in (True, False):
        ours = mlx_kernels.rope(mx.array(q), inv, mx.array(np.array([30], np.int32)), 64, traditional, 1.0)
        theirs = mx.fast.rope(mx.array(q), 64, traditional=traditional, base=1e5, scale=1.0, offset=30)
        assert np.abs(np.array(ours) - np.array(theirs)).max() < 1e-4


def test_a_cache_append_writes_in_place():
    rng = np.random.default_rng(10)
    cache = mx.zeros((1, 2, 16, 8))  # a broadcast zeros: first copied into memory of its own
    k1 = _x(rng, 1, 2, 3, 8)
    c1 = mlx_kernels.write_tokens(cache, mx.array(k1), 0)
    mx.eval(c1)
    address = np.asarray(c1).ctypes.data
    k2 = mx.array(_x(rng, 1, 4, 2, 8)).transpose(0, 2, 1, 3)  # a strided view, as heads() gives
    c2 = mlx_kernels.write_tokens(c1, k2, 3)
    mx.eval(c2)
    assert np.asarray(c2).ctypes.data == address, "the append wrote into the cache's own memory"
    want = np.zeros((1, 2, 16, 8), np.float32)
    want[:, :, :3], want[:, :, 3:7] = k1, np.array(k2)
    assert np.array_equal(np.array(c2), want)
    with pytest.raises(ValueError, match="run past the buffer"):
        mlx_kernels.write_tokens(c2, k2, 15)


def test_an_mlx_version_the_extension_was_not_built_for_is_named(monkeypatch):
    monkeypatch.setattr(mlx_kernels, "_EXT", None)
    monkeypatch.setattr(mx, "__version__", "0.0.1")
    with pytest.raises(mlx_kernels.KernelUnavailableError, match="built for MLX .* and MLX 0.0.1 is installed"):
        mlx_kernels.extension()


def test_a_missing_extension_is_one_line_naming_the_fix(monkeypatch):
    import importlib

    real = importlib.import_module

    def without_extension(name, *a, **k):
        if name.endswith("._mlx_kernels"):
            raise ImportError("No module named '_mlx_kernels'")
        return real(name, *a, **k)

    monkeypatch.setattr(mlx_kernels, "_EXT", None)
    monkeypatch.setattr(importlib, "import_module", without_extension)
    with pytest.raises(mlx_kernels.KernelUnavailableError, match="not built or does not load .*reinstall") as e:
        mlx_kernels.extension()
    assert "\n" not in str(e.value)


def test_strided_inputs_are_gathered_by_the_primitive():
    """An input that is not row-contiguous (a transposed view) is read through its strides: no
    Contiguous node is added to the graph for it."""
    rng = np.random.default_rng(12)
    _, words, scales, biases = quantized(rng, 64, 128, 4, 32)
    m = StoredMatrix(words, scales, biases, 4, 32)
    x = _x(rng, 128, 3)
    xt = mx.array(x).T
    assert np.array_equal(np.array(mlx_kernels.GraphMatrix(m, 1)(xt)), m(np.ascontiguousarray(x.T), 1))
    w = _x(rng, 128)
    got = np.array(mlx_kernels.rms_norm(xt, mx.array(w), 1e-5))
    assert np.abs(got - rms_norm_ref(np.ascontiguousarray(x.T), w, 1e-5)).max() < 1e-5


def test_framework_array_views_the_read_buffer_without_a_copy():
    """A slab of framework_buffer memory becomes an mx.array over the same bytes (what the Metal sparse
    kernel reads on a Mac): a write through numpy after the array was made is what it evaluates to;
    memory MLX did not allocate is copied, so a later write does not reach the array."""
    buf = mlx_kernels.framework_buffer(3 * 4096)
    slab = buf[4096 : 4096 + 6 * 100].reshape(6, 100)
    arr = mlx_kernels.framework_array(slab)
    slab[:] = np.arange(600, dtype=np.uint8).reshape(6, 100)
    assert arr.shape == (6, 100) and arr.dtype == mx.uint8
    assert np.array_equal(np.array(arr), slab)
    plain = np.zeros((6, 100), np.uint8)
    copied = mlx_kernels.framework_array(plain)
    mx.eval(copied)
    plain[:] = 7
    assert not np.array(copied).any()
