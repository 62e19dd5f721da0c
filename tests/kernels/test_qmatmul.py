"""The CPU quantized matmul (kernels/cpu/qmatmul.cpp) against its plain-ops reference, on every code
path this CPU can run, across bits, group sizes, both weight orientations, decode and prefill token
counts and thread counts; plus its refusals of malformed arguments."""

import numpy as np
import pytest

from mlx_flash.errors import KernelUnavailableError
from mlx_flash.kernels.qmatmul import Isa, StoredMatrix, float_paths, qmatmul, runnable_isas, use_isa
from mlx_flash.kernels.qmatmul_ref import dequantize, qmatmul_ref, unpack_codes

from kernel_vectors import lay_out, quantized

RUNNABLE = float_paths()  # the float arithmetic's loops


def test_unpacking_matches_the_layout():
    rng = np.random.default_rng(1)
    for bits in (2, 4, 8):
        codes, words, _, _ = quantized(rng, 3, 64, bits, 32)
        assert np.array_equal(unpack_codes(words, bits), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, 16])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 12])
def test_kernel_equals_reference_on_every_path(bits, group, transposed, tokens, isa_restored):
    rng = np.random.default_rng(bits * 1000 + group + tokens)
    n_out, k_in = (390 if transposed else 384), 512  # 390 rows: blocks of 4 rows leave a remainder
    rows, cols = (n_out, k_in) if transposed else (k_in, n_out)
    _, words, scales, biases = quantized(rng, rows, cols, bits, group)
    x = rng.standard_normal((tokens, k_in)).astype(np.float32)
    ref = qmatmul_ref(x, words, scales, biases, bits, group, transposed)
    results = []
    for isa in RUNNABLE:
        use_isa(isa)
        for threads in (1, 2, 3):
            y = qmatmul(x, words, scales, biases, bits, group, transposed, threads=threads)
            assert y.shape == (tokens, n_out)
            rel = np.abs(y - ref).max() / np.abs(ref).max()
            assert rel < 5e-6, f"{isa.name} threads={threads}: relative error {rel:.2e}"
            results.append(y)
    # Threads split outputs, never a sum: every thread count gives the same bits on one path.
    per_path = len(results) // len(RUNNABLE)
    for i in range(0, len(results), per_path):
        assert all(np.array_equal(results[i], r) for r in results[i : i + per_path])


@pytest.mark.parametrize("scale_dtype", [np.float32, "bfloat16"])
def test_float32_and_bfloat16_scales(scale_dtype):
    rng = np.random.default_rng(7)
    if scale_dtype == "bfloat16":
        _, words, s32, b32 = quantized(rng, 64, 256, 4, 32, np.float32)
        # bfloat16 words: the top half of float32 (truncation keeps the values exactly representable)
        s16, b16 = (s32.view(np.uint32) >> 16).astype(np.uint16), (b32.view(np.uint32) >> 16).astype(np.uint16)
        s_ref = (s16.astype(np.uint32) << 16).view(np.float32)
        b_ref = (b16.astype(np.uint32) << 16).view(np.float32)
        x = rng.standard_normal((2, 256)).astype(np.float32)
        y = qmatmul(x, words, s16, b16, 4, 32, bf16_scales=True)
        ref = qmatmul_ref(x, words, s_ref, b_ref, 4, 32)
    else:
        _, words, s, b = quantized(rng, 64, 256, 4, 32, np.float32)
        x = rng.standard_normal((2, 256)).astype(np.float32)
        y, ref = qmatmul(x, words, s, b, 4, 32), qmatmul_ref(x, words, s, b, 4, 32)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 5e-6


def test_computes_on_views_of_a_bigger_slab_without_copying():
    """A neuron-cache slab's first `count` rows are a view; the kernel reads them in place."""
    rng = np.random.default_rng(3)
    _, words, scales, biases = quantized(rng, 256, 128, 4, 32)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    out = np.empty((1, 100), dtype=np.float32)
    y = qmatmul(x, words[:100], scales[:100], biases[:100], 4, 32, out=out)
    assert y is out
    assert np.abs(y - qmatmul_ref(x, words[:100], scales[:100], biases[:100], 4, 32)).max() < 1e-4


def test_dequantized_reference_is_the_affine_formula():
    rng = np.random.default_rng(5)
    codes, words, scales, biases = quantized(rng, 2, 64, 4, 32)
    w = dequantize(words, scales, biases, 4, 32)
    g = 1  # second group of row 0
    expect = codes[0, 32:64] * float(scales[0, g]) + float(biases[0, g])
    assert np.allclose(w[0, 32:64], expect)


def test_refuses_malformed_arguments():
    rng = np.random.default_rng(2)
    _, words, scales, biases = quantized(rng, 64, 128, 4, 32)
    x = np.ones((1, 128), dtype=np.float32)
    with pytest.raises(ValueError, match="bits"):
        qmatmul(x, words, scales, biases, 3, 32)  # 3-bit codes straddle words: not this kernel's layout
    with pytest.raises(ValueError, match=r"x must be \[T, 128\] \(got shape \(1, 64\)\)"):
        qmatmul(np.ones((1, 64), np.float32), words, scales, biases, 4, 32)
    m = StoredMatrix(words, scales, biases, 4, 32)
    with pytest.raises(ValueError, match="x must hold 128 float32 values"):  # checked by the kernel itself
        m(np.ones((1, 128), np.float64))
    with pytest.raises(ValueError, match="x must be a C-contiguous"):
        m(np.ones((128, 2), np.float32).T[:1])
    with pytest.raises(ValueError, match="out must be"):
        m(x, out=np.empty((1, 63), np.float32))
    with pytest.raises(ValueError, match="out must be a C-contiguous writable"):
        ro = np.empty((1, 64), np.float32)
        ro.flags.writeable = False
        m(x, out=ro)
    with pytest.raises(ValueError, match="scales must be"):
        qmatmul(x, words, scales[:, :2], biases, 4, 32)
    with pytest.raises(ValueError, match="C-contiguous"):
        qmatmul(x, np.asfortranarray(words), scales, biases, 4, 32)
    with pytest.raises(ValueError, match="differ in type"):
        qmatmul(x, words, scales, biases.astype(np.float32), 4, 32)
    with pytest.raises(ValueError, match="group size"):
        qmatmul(x, words, scales, biases, 4, 12)


def test_forcing_a_path_the_cpu_lacks_is_refused(isa_restored):
    lacking = [isa for isa in Isa if isa not in runnable_isas()]
    if not lacking:
        pytest.skip("this CPU runs every path")
    with pytest.raises(KernelUnavailableError, match="cannot run"):
        use_isa(lacking[0])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("as_groups", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_laid_out_rows_are_read_in_place(bits, as_groups, tokens, isa_restored):
    """Rows interleaved in bundles (as a layer read from flash lies in memory) multiply exactly as the
    same matrix stored plainly, on every path, without the kernel copying them out."""
    rng = np.random.default_rng(bits + 10 * tokens + as_groups)
    group, n_out, k_in = 32, 96, 256
    _, words, scales, biases = quantized(rng, n_out, k_in, bits, group)
    w, s, b = lay_out(words, scales, biases, bits, group, 32, as_groups)
    x = rng.standard_normal((tokens, k_in)).astype(np.float32)
    ref = qmatmul_ref(x, words, scales, biases, bits, group, True)
    m = StoredMatrix(w, s, b, bits, group)
    assert (m.n_out, m.k_in) == (n_out, k_in)
    assert m.arrays[0].ctypes.data == w.ctypes.data, "the kernel reads the laid-out bytes, not a copy"
    for isa in RUNNABLE:
        use_isa(isa)
        for threads in (1, 2):
            y = m(x, threads)
            rel = np.abs(y - ref).max() / np.abs(ref).max()
            assert rel < 5e-6, f"{isa.name} threads={threads}: relative error {rel:.2e}"


def test_laid_out_rows_are_checked():
    rng = np.random.default_rng(3)
    _, words, scales, biases = quantized(rng, 64, 128, 4, 32)
    w, s, b = lay_out(words, scales, biases, 4, 32, 32, False)
    with pytest.raises(ValueError, match="biases must lie like the scales"):
        StoredMatrix(w, s, b[:, :, ::-1].copy(), 4, 32)
    with pytest.raises(ValueError, match="scales view must be"):
        StoredMatrix(w, s[:, :1], b[:, :1], 4, 32)
    with pytest.raises(ValueError, match="rows_are_outputs matrices only"):
        StoredMatrix(w, s, b, 4, 32, rows_are_outputs=False)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_groups_apart_decode_equals_the_plain_matrix_bit_for_bit(bits, group, isa_restored):
    """Decode over a matrix whose groups are bundles (the down matrix of a block store) walks it group
    by group, not row by row; each row's sum takes the same operations in the same order, so the
    result is the plain matrix's to the bit. 9 groups: passes of GROUP_PASS groups and a short one."""
    rng = np.random.default_rng(bits + group)
    n_out, k_in = 96, 9 * group
    _, words, scales, biases = quantized(rng, n_out, k_in, bits, group)
    w, s, b = lay_out(words, scales, biases, bits, group, 32, True)
    x = rng.standard_normal((1, k_in)).astype(np.float32)
    laid_out, plain = StoredMatrix(w, s, b, bits, group), StoredMatrix(words, scales, biases, bits, group)
    for isa in RUNNABLE:
        use_isa(isa)
        for threads in (1, 2):
            assert np.array_equal(laid_out(x, threads), plain(x, threads)), f"{isa.name} threads={threads}"
