"""T-MAC's table-lookup product (kernels/cpu/tmac.cpp): its repacked layout and its tables equal the
plain-ops reference's (kernels/tmac_ref.py) byte for byte, and its outputs equal the reference's to
the bit on every path this CPU runs (portable, AVX-512 BW, VNNI, VBMI) and for 1 and 2 threads,
extreme codes (0 and 15: every lookup at index 0 or 15, int16 sums at their largest) and extreme
activations included. Its distance to the exact product is the tables' rounding, which has a
worst-case bound per row (each entry off by at most half a table step) that every output keeps."""

import numpy as np
import pytest

from mlx_flash.kernels.q8_ref import q8_matmul_ref
from mlx_flash.kernels.qmatmul_ref import dequantize
from mlx_flash.kernels.tmac import TmacMatrix, TmacPath, tmac_paths, tmac_tables
from mlx_flash.kernels.tmac_ref import repack_ref, tables, tmac_matvec_ref

from kernel_vectors import quantized

PATHS = tmac_paths()
VECTOR_PATHS = [p for p in PATHS if p != TmacPath.PORTABLE]
needs_avx512 = pytest.mark.skipif(
    not VECTOR_PATHS, reason="this CPU has no AVX-512 (F, BW, VL): only the portable T-MAC path runs here"
)


def words_of(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [N, K] -> the store's uint32 words (code j at bits 4 (j % 8))."""
    c = codes.astype(np.uint32).reshape(codes.shape[0], -1, 8)
    return np.bitwise_or.reduce(c << (4 * np.arange(8, dtype=np.uint32)), axis=2)


def every_path(m: TmacMatrix, x: np.ndarray) -> np.ndarray:
    """The product on every path and 1 and 2 threads; asserts they agree to the bit, returns one."""
    first = None
    for path in PATHS:
        for threads in (1, 2):
            y = m(x, threads, path=path)
            if first is None:
                first = y
            assert np.array_equal(y, first), f"{path.name} threads={threads} differs from {PATHS[0].name}"
    return first


def activations(rng, K: int) -> np.ndarray:
    """Rows of x at several scales, with an all-zero group (table scale 0), a lone huge input (the
    rest of its group's entries round to 0) and tiny ones."""
    x = (rng.standard_normal(K) * rng.uniform(0.01, 10, K // 32).repeat(32)).astype(np.float32)
    x[:32] = 0.0
    if K > 64:
        x[40] = 1e30
        x[64:96] *= np.float32(1e-30)
    return x


@pytest.mark.parametrize("K", [32, 96, 576, 1024])
def test_tables_equal_the_reference(K):
    x = activations(np.random.default_rng(K), K)
    q_ref, d_ref, s_ref = tables(x)
    assert np.abs(q_ref.astype(np.int32)).max() <= 127
    for path in PATHS:
        q, d, s = tmac_tables(x, path)
        assert np.array_equal(q, q_ref), path.name
        assert np.array_equal(d.view(np.uint32), d_ref.view(np.uint32)), path.name
        assert np.array_equal(s.view(np.uint32), s_ref.view(np.uint32)), path.name


@pytest.mark.parametrize("n_out", [1, 16, 67])
def test_repacked_layout_equals_the_reference(n_out):
    _, words, scales, biases = quantized(np.random.default_rng(n_out), n_out, 96, 4, 32)
    m = TmacMatrix(words, scales, biases)
    assert np.array_equal(m.data, repack_ref(words, scales, biases))
    assert m.nbytes == -(-n_out // 16) * 16 * (96 // 2 + 96 // 32 * 4)  # the store's size, rows padded to 16


@pytest.mark.parametrize("n_out, k_in", [(16, 32), (67, 256), (300, 576), (48, 1536)])
def test_kernel_equals_the_reference_on_every_path(n_out, k_in):
    rng = np.random.default_rng(n_out + k_in)
    _, words, scales, biases = quantized(rng, n_out, k_in, 4, 32)
    for x in (rng.standard_normal(k_in).astype(np.float32), activations(rng, k_in)):
        y = every_path(TmacMatrix(words, scales, biases), x)
        assert np.array_equal(y, tmac_matvec_ref(x, words, scales, biases))


@pytest.mark.parametrize("code", [0, 15, "alternating"])
@pytest.mark.parametrize("sign", [1.0, -1.0, "mixed"])
def test_extreme_codes_and_activations(code, sign):
    """Codes all 15 with x all of one sign put every lookup at +-127 (index 15: the largest entry)
    and the BW path's int16 group sums at their largest (12192 a half); codes 0 look up entry 0;
    alternating 0 and 15 rows mix them. Any saturation or dropped lookup would be off by thousands."""
    n_out, k_in = 35, 640
    codes = np.full((n_out, k_in), 0 if code == 0 else 15, np.uint8)
    if code == "alternating":
        codes[::2] = 0
    words = words_of(codes)
    scales = np.full((n_out, k_in // 32), 0.5, np.float16)
    biases = np.full((n_out, k_in // 32), -1.0, np.float16)
    x = np.full(k_in, 3.0, np.float32)
    if sign == -1.0:
        x = -x
    elif sign == "mixed":
        x[1::2] *= -1e4
    q, _, _ = tables(x)
    if sign != "mixed":
        assert np.abs(q[:, 15].astype(np.int32)).min() == 127
    y = every_path(TmacMatrix(words, scales, biases), x)
    assert np.array_equal(y, tmac_matvec_ref(x, words, scales, biases))


@needs_avx512
def test_avx512_equals_portable_on_a_model_shape():
    """A default-model shape (1536 x 576): every vector path and both thread counts, the same bits
    as the portable loop."""
    rng = np.random.default_rng(5)
    _, words, scales, biases = quantized(rng, 1536, 576, 4, 32)
    m = TmacMatrix(words, scales, biases)
    x = rng.standard_normal(576).astype(np.float32)
    portable = m(x, 1, path=TmacPath.PORTABLE)
    for path in VECTOR_PATHS:
        for threads in (1, 2):
            assert np.array_equal(m(x, threads, path=path), portable), f"{path.name} threads={threads}"


def test_error_to_the_exact_product_is_within_the_tables_rounding():
    """Each table entry is off by at most half its group's step d = max|T| / 127, and a row looks up 8
    entries a plane, weighted 1, 2, 4, 8: at most 8 * 15 * d / 2 = 60 d a group, times |scale|. The
    bias term is float (the group sum of x is not quantized). So |y - exact| <= sum_g |s_g| 60 d_g,
    plus float32 rounding; every output keeps it. In practice the roundings cancel (the largest
    error is 7-16% of the bound): on Gaussian x and random matrices with the tests' scales (std 0.02,
    biases 0.1), the largest error was 0.37-0.62% of the largest output over 6 seeds and both default
    model shapes, against 0.27-0.49% for the q8 arithmetic (a scale per 8 inputs), at most 1.6 times
    it; asserted: below 1%, and below twice q8's."""
    rng = np.random.default_rng(9)
    n_out, k_in = 1536, 576
    _, words, scales, biases = quantized(rng, n_out, k_in, 4, 32)
    w = dequantize(words, scales, biases, 4, 32)
    x = rng.standard_normal(k_in).astype(np.float32)
    exact = w @ x.astype(np.float64)
    y = TmacMatrix(words, scales, biases)(x)
    _, d, _ = tables(x)
    bound = np.abs(scales.astype(np.float64)) @ (60 * d.astype(np.float64))
    floats = np.abs(w) @ np.abs(x.astype(np.float64)) * 2e-6  # float32 steps: a few ulps of the terms
    assert np.all(np.abs(y - exact) <= bound + floats)
    relative = np.abs(y - exact).max() / np.abs(exact).max()
    q8 = np.abs(q8_matmul_ref(x[None], w)[0] - exact).max() / np.abs(exact).max()
    assert relative < 0.01, relative
    assert relative < 2 * q8, (relative, q8)
