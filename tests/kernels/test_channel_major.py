"""The channel-major product (kernels/cpu/channel_major.cpp) against its plain-ops reference on every
code path this CPU can run: widths, group sizes, scale types, output counts off the tile, decode and
multi-row token counts, thresholds (none zeroed, half, nearly all, and negative: the dense product,
also against the row-major kernel); the relayout byte for byte, plain and laid out inside bundles;
the counters; the torch operator and the MLX primitive against the numpy path; and the refusals."""

import ctypes
import importlib.util

import numpy as np
import pytest

from mlx_flash.host_memory import anonymous_buffer
from mlx_flash.kernels.channel_major import ChannelMajorMatrix, _lib, cm_bytes
from mlx_flash.kernels.channel_major_ref import cm_counts, cm_matmul_ref, relayout_ref
from mlx_flash.kernels.qmatmul import StoredMatrix, float_paths, unpack_codes, use_isa

from kernel_vectors import lay_out, quantized

PATHS = float_paths()  # the product follows the float arithmetic's choice of loops
N_OUT, K_IN = 300, 384  # 300 outputs: a full tile of 256 and one of 64, 20 of them padding


def stored(rng, n, k, bits, group, scale_type="float16"):
    """(StoredMatrix, packed, float scales, float biases) with `scale_type` scales; bfloat16 ones are
    the top halves of float32 values (so the float reference holds them exactly)."""
    dtype = np.float16 if scale_type == "float16" else np.float32
    _, words, s, b = quantized(rng, n, k, bits, group, dtype)
    if scale_type != "bfloat16":
        return StoredMatrix(words, s, b, bits, group), words, s, b
    s16, b16 = ((a.view(np.uint32) >> 16).astype(np.uint16) for a in (s, b))
    widen = [(a.astype(np.uint32) << 16).view(np.float32) for a in (s16, b16)]
    return StoredMatrix(words, s16, b16, bits, group, bf16_scales=True), words, *widen


def thresholds(x):
    """Zero, about half of |x|, nearly all of it, and negative (every channel)."""
    return [0.0, float(np.median(np.abs(x))), float(np.quantile(np.abs(x), 0.97)), -1.0]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("scale_type", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_kernel_equals_reference_on_every_path(bits, group, scale_type, tokens, isa_restored):
    rng = np.random.default_rng(bits * 100 + group + tokens)
    m, words, s, b = stored(rng, N_OUT, K_IN, bits, group, scale_type)
    cm = ChannelMajorMatrix.from_stored(m)
    x = rng.standard_normal((tokens, K_IN)).astype(np.float32)
    for threshold in thresholds(x):
        ref = cm_matmul_ref(x, words, s, b, bits, group, threshold)
        scale = max(np.abs(ref).max(), 1e-30)
        results = []
        for isa in PATHS:
            use_isa(isa)
            for threads in (1, 2, 3):
                before = cm.counters.copy()
                y = cm.matmul(x, threshold, threads=threads)
                rel = np.abs(y - ref).max() / scale
                assert rel < 1e-5, f"{isa.name} threads={threads} threshold={threshold}: relative error {rel:.2e}"
                assert np.array_equal(cm.counters - before, cm_counts(x, group, threshold))
                results.append(y)
        # threads split tiles of outputs, never a sum: every thread count gives the same bits on a path
        for i in range(0, len(results), 3):
            assert all(np.array_equal(results[i], r) for r in results[i : i + 3])


@pytest.mark.parametrize("n_out", [64, 200, 576, 960])
def test_threads_split_outputs_in_steps_of_64(n_out, isa_restored):
    """Every thread count splits the outputs at multiples of 64, a range's last tile narrower than 256
    (576 on 2 threads: 256 and 320), and gives the same bits as one thread."""
    rng = np.random.default_rng(n_out)
    m, words, s, b = stored(rng, n_out, 128, 4, 32)
    cm = ChannelMajorMatrix.from_stored(m)
    for tokens in (1, 4):
        x = rng.standard_normal((tokens, 128)).astype(np.float32)
        for threshold in (-1.0, 0.5):
            ref = cm_matmul_ref(x, words, s, b, 4, 32, threshold)
            for isa in PATHS:
                use_isa(isa)
                one = cm.matmul(x, threshold)
                assert np.abs(one - ref).max() / np.abs(ref).max() < 1e-5, isa.name
                for threads in (2, 3, 5):
                    assert np.array_equal(cm.matmul(x, threshold, threads=threads), one), (isa.name, threads)


def test_the_layout_holds_the_outputs_padded_to_64_only():
    """576 outputs take 576 outputs' bytes (not a tile of 256's 768); channel_bytes and group_bytes
    add up to the layout's size."""
    for n, padded in ((576, 576), (960, 960), (300, 320), (64, 64), (65, 128)):
        for bits, scale_type, ssize in ((4, 0, 2), (8, 2, 4), (2, 1, 2)):
            size = cm_bytes(n, 256, bits, 64, scale_type)
            cm = ChannelMajorMatrix(anonymous_buffer(size), n, 256, bits, 64, scale_type)
            assert cm.channel_bytes == padded * bits // 8 and cm.group_bytes == 2 * padded * ssize
            assert size == 4 * (64 * cm.channel_bytes + cm.group_bytes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 5])
def test_dense_equals_the_row_major_kernel(bits, tokens, isa_restored):
    rng = np.random.default_rng(bits + tokens)
    m, *_ = stored(rng, 520, 512, bits, 32)
    cm = ChannelMajorMatrix.from_stored(m)
    x = rng.standard_normal((tokens, 512)).astype(np.float32)
    for isa in PATHS:
        use_isa(isa)
        y, dense = cm.matmul(x, -1.0, threads=2), m(x, 2)
        assert np.abs(y - dense).max() / np.abs(dense).max() < 1e-5, isa.name


def test_a_row_does_not_depend_on_the_rows_beside_it(isa_restored):
    """A multi-row product computes each row in the order the row alone would (the others' inactive
    channels add +0): the same bits, on every path."""
    rng = np.random.default_rng(3)
    m, *_ = stored(rng, N_OUT, K_IN, 4, 32)
    cm = ChannelMajorMatrix.from_stored(m)
    x = rng.standard_normal((9, K_IN)).astype(np.float32)
    for isa in PATHS:
        use_isa(isa)
        for threshold in (-1.0, 0.6):
            together = cm.matmul(x, threshold)
            for t in range(9):
                assert np.array_equal(cm.matmul(x[t : t + 1], threshold), together[t : t + 1]), (isa.name, t)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("scale_type", ["float16", "bfloat16", "float32"])
def test_relayout_equals_the_numpy_layout_byte_for_byte(bits, scale_type):
    rng = np.random.default_rng(bits)
    m, words, *_ = stored(rng, N_OUT, K_IN, bits, 64, scale_type)
    cm = ChannelMajorMatrix.from_stored(m, threads=2)
    _, s, b = m.parts  # the stored bytes: bfloat16 as its uint16 words
    assert cm.nbytes == cm_bytes(N_OUT, K_IN, bits, 64, m.scale_type) == cm.buffer.nbytes
    assert np.array_equal(cm.buffer, relayout_ref(unpack_codes(words, bits), s, b, bits, 64))


@pytest.mark.parametrize("as_groups", [False, True])
def test_laid_out_matrices_are_read_through_their_strides(as_groups):
    """Rows in blocks inside bundles, or each group in its own bundle: the same layout as the plain
    matrix, to the byte, so the same products."""
    rng = np.random.default_rng(4)
    _, words, s, b = quantized(rng, 320, 256, 4, 32)
    plain = ChannelMajorMatrix.from_stored(StoredMatrix(words, s, b, 4, 32))
    views = lay_out(words, s, b, 4, 32, 32, as_groups)
    laid = ChannelMajorMatrix.from_stored(StoredMatrix(*views, 4, 32), threads=3)
    assert np.array_equal(laid.buffer, plain.buffer)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    assert np.array_equal(laid.matmul(x, 0.4), plain.matmul(x, 0.4))


def test_counters_report_the_zeroed_share_and_the_bytes_skipped():
    rng = np.random.default_rng(5)
    m, *_ = stored(rng, N_OUT, K_IN, 4, 32)
    cm = ChannelMajorMatrix.from_stored(m)
    x = rng.standard_normal((4, K_IN)).astype(np.float32)
    assert cm.zeroed_share() == 0.0 and cm.bytes_skipped() == 0
    cm.matmul(x, -1.0)
    assert list(cm.counters) == [4, 4 * K_IN, 4 * K_IN // 32] and cm.bytes_skipped() == 0
    mine = np.zeros(3, np.int64)  # a caller's own counters; the matrix's stay as they were
    y = cm.matmul(x, 1e9, counters=mine)
    assert not y.any() and list(mine) == [4, 0, 0] and list(cm.counters) == [4, 4 * K_IN, 4 * K_IN // 32]
    assert cm.zeroed_share(mine) == 1.0 and cm.bytes_skipped(mine) == 4 * cm.nbytes
    one = np.zeros(3, np.int64)
    cm.matmul(x[0], float(np.median(np.abs(x[0]))), counters=one)
    assert one[1] == K_IN // 2 and abs(cm.zeroed_share(one) - 0.5) < 1e-9


def test_bad_arguments_are_refused_with_a_reason():
    rng = np.random.default_rng(6)
    _, words, s, b = quantized(rng, 64, 128, 4, 16)
    with pytest.raises(ValueError, match="group size must be 32"):
        ChannelMajorMatrix.from_stored(StoredMatrix(words, s, b, 4, 16))
    with pytest.raises(ValueError, match="rows are outputs"):
        ChannelMajorMatrix.from_stored(StoredMatrix(words, s, b, 4, 16, rows_are_outputs=False))
    with pytest.raises(ValueError, match="writable uint8"):
        ChannelMajorMatrix.from_stored(StoredMatrix(*quantized(rng, 64, 128, 4, 32)[1:], 4, 32), lambda n: None)
    cm = ChannelMajorMatrix.from_stored(StoredMatrix(*quantized(rng, 64, 128, 4, 32)[1:], 4, 32))
    x = np.ones((2, 128), np.float32)
    for bad in (np.ones((2, 64), np.float32), np.ones((2, 128)), np.ones((128, 2), np.float32).T):
        with pytest.raises(ValueError, match="x must be"):
            cm.matmul(bad, 0.0)
    with pytest.raises(ValueError, match="NaN"):
        cm.matmul(x, float("nan"))
    with pytest.raises(ValueError, match="out must be"):
        cm.matmul(x, 0.0, out=np.empty((2, 63), np.float32))
    with pytest.raises(ValueError, match="counters must be"):
        cm.matmul(x, 0.0, counters=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8"):
        cm_bytes(64, 128, 3, 32, 0)
    with pytest.raises(ValueError, match="buffer of"):
        ChannelMajorMatrix(anonymous_buffer(10), 64, 128, 4, 32, 0)
    # the library's own checks, for callers that reach it without the binding
    lib, y = _lib(), np.empty((2, 64), np.float32)
    call = [cm.buffer.ctypes.data, 64, 128, 4, 32, 0, x.ctypes.data, 2, 0.0, y.ctypes.data, 1, None]
    for at, value, code in ((3, 5, -1), (4, 48, -2), (2, 100, -3), (5, 3, -4), (7, -1, -7), (0, None, -6)):
        args = list(call)
        args[at] = value
        assert lib.mf_cm_matmul(*args) == code
    assert lib.mf_cm_matmul(*call[:8], ctypes.c_float(float("nan")), *call[9:]) == -8
    assert lib.mf_cm_matmul(*call) == 0


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")


@needs_torch
def test_the_torch_operator_equals_the_numpy_path():
    import torch

    from mlx_flash.kernels import torch_ops

    rng = np.random.default_rng(7)
    m, *_ = stored(rng, N_OUT, K_IN, 4, 32)
    cm = ChannelMajorMatrix.from_stored(m, torch_ops.framework_buffer)  # the layout in torch memory
    op = torch_ops.TorchChannelMajor(cm, 2)
    tensor, offset = torch_ops.tensor_of(cm.buffer)
    assert op.buffer.data_ptr() + op.offset == cm.buffer.ctypes.data == tensor.data_ptr() + offset
    x = rng.standard_normal((2, 3, K_IN)).astype(np.float32)
    mine = np.zeros(3, np.int64)
    for threshold in (-1.0, 0.0, 0.7, np.float32(0.5)):
        before, dense_before = cm.counters.copy(), op.dense_counters.numpy().copy()
        y = op(torch.from_numpy(x), threshold)
        assert y.shape == (2, 3, N_OUT)
        assert np.array_equal(y.numpy().reshape(6, -1), cm.matmul(x.reshape(6, -1), threshold, counters=mine))
        # thresholded products count into the matrix's counters, dense ones (threshold < 0) apart
        counted, none = cm_counts(x.reshape(6, -1), 32, threshold), np.zeros(3, np.int64)
        assert np.array_equal(cm.counters - before, counted if threshold >= 0 else none)
        assert np.array_equal(op.dense_counters.numpy() - dense_before, none if threshold >= 0 else counted)
    ops, spec = torch_ops.ops(), list(op.spec)
    with pytest.raises(RuntimeError, match="lie past their buffer"):
        ops.cm_matmul(torch.ones(1, K_IN), op.buffer[:100], [0, *spec[1:]], 0.0, 1)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.cm_matmul(torch.ones(1, 5), op.buffer, spec, 0.0, 1)
    with pytest.raises(RuntimeError, match="refuses this matrix"):
        ops.cm_matmul(torch.ones(1, K_IN), op.buffer, [*spec[:4], 48, 0], 0.0, 1)
    with pytest.raises(RuntimeError, match="6 ints"):
        ops.cm_matmul(torch.ones(1, K_IN), op.buffer, spec[1:], 0.0, 1)
    with pytest.raises(RuntimeError, match="offset must not be negative"):
        ops.cm_matmul(torch.ones(1, K_IN), op.buffer, [-64, *spec[1:]], 0.0, 1)
    with pytest.raises(RuntimeError, match="NaN"):
        ops.cm_matmul(torch.ones(1, K_IN), op.buffer, spec, float("nan"), 1)
    with pytest.raises(RuntimeError, match="counters must be"):
        ops.cm_matmul(torch.ones(1, K_IN), op.buffer, spec, 0.0, 1, torch.zeros(3))
    torch.library.opcheck(
        ops.cm_matmul.default,
        (torch.ones(3, K_IN), op.buffer, spec, 0.5, 1, torch.zeros(3, dtype=torch.int64)),
        test_utils=("test_faketensor",),
    )


@needs_mlx
def test_the_mlx_primitive_equals_the_numpy_path():
    import mlx.core as mx

    from mlx_flash.kernels import mlx_kernels

    rng = np.random.default_rng(8)
    m, *_ = stored(rng, N_OUT, K_IN, 8, 64, "bfloat16")
    cm = ChannelMajorMatrix.from_stored(m, mlx_kernels.framework_buffer)  # the layout in MLX memory
    g = mlx_kernels.GraphChannelMajor(cm, 2)
    assert mlx_kernels.buffer_of(cm.buffer) is not None
    x = rng.standard_normal((2, 3, K_IN)).astype(np.float32)
    ext = mlx_kernels.extension()
    ext.record_inputs(True)
    try:
        mx.eval(g(mx.array(x), 0.0))
        assert ext.recorded_inputs() == [("ChannelMajorMatmul", cm.buffer.ctypes.data)]  # read where it lies
    finally:
        ext.record_inputs(False)
    g.reset_counters()
    expected, dense = np.zeros(3, np.int64), g.dense_counters
    for threshold in (-1.0, 0.0, 0.7, np.float32(0.5)):
        y = g(mx.array(x), threshold)
        assert y.shape == (2, 3, N_OUT)
        assert np.array_equal(np.array(y).reshape(6, -1), cm.matmul(x.reshape(6, -1), threshold))
        # thresholded products count into `counters`, dense ones (threshold < 0) apart
        counted = cm_counts(x.reshape(6, -1), 64, threshold)
        expected, dense = (expected + counted, dense) if threshold >= 0 else (expected, dense + counted)
        assert np.array_equal(g.counters, expected) and np.array_equal(g.dense_counters, dense)
    plain = mlx_kernels.GraphChannelMajor(ChannelMajorMatrix.from_stored(m), 1)  # numpy memory: copied once
    assert np.array_equal(np.array(plain(mx.array(x), 0.5)), np.array(g(mx.array(x), 0.5)))
    with pytest.raises(ValueError, match="x must be"):
        g(mx.ones((2, 5)), 0.0)
    with pytest.raises(ValueError, match="NaN"):
        g(mx.ones((2, K_IN)), float("nan"))
    with pytest.raises(ValueError, match="past its buffer"):
        ext.cm_matmul(mx.ones((1, K_IN)), g.buffer, 64, N_OUT, K_IN, 8, 64, 1, 0.0, 1)
