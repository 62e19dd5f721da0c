"""The q8 arithmetic (kernels/cpu/q8*.cpp): its quantized activations equal the plain-ops reference's
codes exactly; every stored kind's product equals the reference (dequantized weights times dequantized
activations) up to float32 rounding; and every level this CPU runs (AVX-512 VNNI, AVX-512 BW, AVX-VNNI
in either encoding, AVX2, portable), every thread count, and a row of x alone or in a tile of 4, 16
or 64 rows give the same bits. Extreme codes (the largest weight codes times +-127) would show a
saturating instruction; laid-out, groups-apart and listed matrices equal the plain matrix."""

import numpy as np
import pytest

from mlx_flash.kernels.blockmatmul import BlockMatrix
from mlx_flash.kernels.gguf_blocks_ref import BLOCKS, dequantize as dequantize_blocks
from mlx_flash.kernels.q8_ref import q8_matmul_ref, quantize
from mlx_flash.kernels.qmatmul import Arith, Isa, StoredMatrix, q8_quantize, q8_reads, runnable_isas, use_isa
from mlx_flash.kernels.qmatmul_ref import dequantize

from kernel_vectors import lay_out, quantized, random_bytes

LEVELS = runnable_isas()
GGUF_KINDS = list(BLOCKS)  # Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (Q4_0, Q4_1, Q8_0 are stored as affine 4/8 bits)


def outputs(matrix, x, arith=Arith.Q8):
    """The product on every level and thread count; asserts they agree to the bit, returns one."""
    first = None
    for level in LEVELS:
        use_isa(level)
        for threads in (1, 2, 3):
            y = matrix(x, threads, arith=arith)
            if first is None:
                first = y
            assert np.array_equal(y, first), f"{level.name} threads={threads} differs from {LEVELS[0].name}"
    return first


def relative(y, ref):
    return np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)


@pytest.mark.parametrize("K", [32, 96, 576, 1024])
def test_quantized_codes_equal_the_reference(K):
    rng = np.random.default_rng(K)
    x = (rng.standard_normal((5, K)) * rng.uniform(0.01, 10, (5, 1))).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block: scale 0, codes 0
    x[2, 5] = 1e30  # one huge input: the other codes of its 16 round to zero
    q, d, s = q8_quantize(x)
    q_ref, d_ref, s_ref = quantize(x)
    assert np.array_equal(q, q_ref) and np.array_equal(d.view(np.uint32), d_ref.view(np.uint32))
    assert np.array_equal(s.view(np.uint32), s_ref.view(np.uint32))
    assert q.min() >= -127 and q.max() <= 127


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 3, 8, 20])
@pytest.mark.parametrize("k_in", [3 * 128, 7 * 128, 10 * 128])
def test_affine_equals_reference_on_every_level(bits, group, tokens, k_in, isa_restored):
    """12 blocks: one short run; 28: a run of 16 and a short one of 12; 40: two runs and one of 8. Rows
    of 576 bytes or fewer are decoded 4 at a time, longer ones one at a time."""
    rng = np.random.default_rng(bits * 100 + group + tokens)
    n_out = 67
    _, words, scales, biases = quantized(rng, n_out, k_in, bits, group)
    x = rng.standard_normal((tokens, k_in)).astype(np.float32)
    y = outputs(StoredMatrix(words, scales, biases, bits, group), x)
    ref = q8_matmul_ref(x, dequantize(words, scales, biases, bits, group))
    assert relative(y, ref) < 2e-6


@pytest.mark.parametrize("kind", GGUF_KINDS)
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_gguf_kinds_equal_reference_on_every_level(kind, tokens, isa_restored):
    weights = BLOCKS[kind].weights
    raw = random_bytes(kind, 45, (1280 if weights == 256 else 800) // weights * BLOCKS[kind].nbytes, seed=tokens)
    k_in = raw.shape[1] // BLOCKS[kind].nbytes * weights
    x = np.random.default_rng(tokens).standard_normal((tokens, k_in)).astype(np.float32)
    y = outputs(BlockMatrix(raw, kind), x)
    assert relative(y, q8_matmul_ref(x, dequantize_blocks(raw, kind))) < 2e-6


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_extreme_codes_do_not_saturate(bits, isa_restored):
    """Every weight code at its largest (255 for 8 bits) times activation codes of +-127 (x alternating
    +-1 gives exactly those): a product of pairs that saturates at 16 bits (vpmaddubsw) would be off by
    thousands; the exact sums are integers, so every level must give the reference's value."""
    n_out, k_in, group = 33, 576, 32
    words = np.full((n_out, k_in * bits // 32), 0xFFFFFFFF, np.uint32)
    scales = np.full((n_out, k_in // group), 0.5, np.float16)
    biases = np.full((n_out, k_in // group), -1.0, np.float16)
    signs = np.where(np.arange(k_in) % 2 == 0, 1.0, -1.0)
    x = np.stack([np.ones(k_in), -np.ones(k_in), signs, np.where(np.arange(k_in) % 64 < 32, 1.0, -1.0)])
    x = x.astype(np.float32)
    assert np.abs(quantize(x)[0]).min() == 127
    y = outputs(StoredMatrix(words, scales, biases, bits, group), x)
    assert np.array_equal(y, q8_matmul_ref(x, dequantize(words, scales, biases, bits, group)).astype(np.float32))


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_extreme_block_codes_do_not_saturate(kind, isa_restored):
    blk = BLOCKS[kind]
    raw = np.full((9, 2 * blk.nbytes), 0xFF, np.uint8).reshape(9, 2, blk.nbytes)
    at = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[kind]
    for a in at:  # finite float16 fields; every code bit set
        raw[..., a : a + 2] = np.array([0.25], np.float16).view(np.uint8)
    raw = raw.reshape(9, -1)
    k_in = 2 * blk.weights
    x = np.where(np.arange(k_in) % 2 == 0, 1.0, -1.0)[None].repeat(3, 0).astype(np.float32)
    x[1] = 1.0
    y = outputs(BlockMatrix(raw, kind), x)
    ref = q8_matmul_ref(x, dequantize_blocks(raw, kind))
    assert relative(y, ref) < 1e-6


@pytest.mark.parametrize("kind", ["affine4", "affine8", "Q5_0", "Q6_K"])
def test_a_row_alone_or_in_tiles_gives_the_same_bits(kind, isa_restored):
    """Prefill chunks, a server's many rows and throughput passes run tiles of rows; a row's output
    must not depend on which rows come with it."""
    rng = np.random.default_rng(11)
    if kind.startswith("affine"):
        bits = int(kind[-1])
        _, words, scales, biases = quantized(rng, 70, 640, bits, 32)
        m = StoredMatrix(words, scales, biases, bits, 32)
    else:
        weights = BLOCKS[kind].weights
        m = BlockMatrix(random_bytes(kind, 70, 768 // weights * BLOCKS[kind].nbytes, seed=2), kind)
    x = rng.standard_normal((64, m.k_in)).astype(np.float32)
    for level in LEVELS:
        use_isa(level)
        alone = np.concatenate([m(x[t : t + 1], 1, arith=Arith.Q8) for t in range(64)])
        for rows in (4, 16, 64):
            for start in range(0, 64, rows):
                together = m(x[start : start + rows], 2, arith=Arith.Q8)
                assert np.array_equal(together, alone[start : start + rows]), f"{level.name}: tile of {rows}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("as_groups, n_out", [(False, 96), (True, 96), (True, 88)])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_laid_out_and_groups_apart_equal_the_plain_matrix(bits, as_groups, n_out, tokens, isa_restored):
    """Rows inside bundles (gate/up of a block store) and groups apart (its down matrix) lie elsewhere
    but hold the same blocks: the same outputs to the bit (88 rows of groups apart: a last run of 8,
    whose lanes past its rows the decode kernel masks; bundles hold whole blocks of 32 rows)."""
    rng = np.random.default_rng(bits + tokens + as_groups)
    k_in, group = 9 * 64, 32
    _, words, scales, biases = quantized(rng, n_out, k_in, bits, group)
    w, s, b = lay_out(words, scales, biases, bits, group, 32, as_groups)
    x = rng.standard_normal((tokens, k_in)).astype(np.float32)
    plain = outputs(StoredMatrix(words, scales, biases, bits, group), x)
    assert np.array_equal(outputs(StoredMatrix(w, s, b, bits, group), x), plain)


def test_listed_blocks_and_groups_equal_their_dense_share(isa_restored):
    """A sparse product over listed row blocks (gate rows of active bundles) or listed groups (the
    down matrix's active bundles) equals the dense product's rows, or the product of the matrix
    whose other groups are gone."""
    rng = np.random.default_rng(5)
    bits, group, n_out, k_in = 4, 32, 96, 8 * 32
    _, words, scales, biases = quantized(rng, n_out, k_in, bits, group)
    x = rng.standard_normal((3, k_in)).astype(np.float32)
    rows = StoredMatrix(*lay_out(words, scales, biases, bits, group, 32, False), bits, group)
    ids = np.array([2, 0], np.int32)
    dense = rows(x, 1, arith=Arith.Q8)
    for level in LEVELS:
        use_isa(level)
        got = rows.sparse(x, ids, 2, arith=Arith.Q8)
        assert np.array_equal(got, np.concatenate([dense[:, 64:96], dense[:, 0:32]], axis=1))
    apart = StoredMatrix(*lay_out(words, scales, biases, bits, group, 32, True), bits, group)
    gids = np.array([1, 4, 6], np.int32)
    cols = np.concatenate([np.arange(g * group, (g + 1) * group) for g in gids])
    wanted = StoredMatrix(
        np.ascontiguousarray(
            np.concatenate([words[:, g * group * bits // 32 : (g + 1) * group * bits // 32] for g in gids], 1)
        ),
        np.ascontiguousarray(scales[:, gids]),
        np.ascontiguousarray(biases[:, gids]),
        bits,
        group,
    )
    xs = np.ascontiguousarray(x[:, cols])
    for level in LEVELS:
        use_isa(level)
        assert np.array_equal(apart.sparse(xs, gids, 2, arith=Arith.Q8), wanted(xs, 1, arith=Arith.Q8))


def test_what_q8_does_not_read_runs_the_float_arithmetic(isa_restored):
    """Neuron-major down columns and groups of 16 have no q8 loops: asked for q8, they compute exactly
    what the float arithmetic computes."""
    rng = np.random.default_rng(8)
    assert not q8_reads(0, 4, 32, False) and not q8_reads(0, 4, 16, True) and not q8_reads(0, 3, 32, True)
    assert q8_reads(0, 4, 64, True) and q8_reads(12, 0, 0, True)
    for transposed, group in ((False, 32), (True, 16)):
        _, words, scales, biases = quantized(rng, 64, 256, 4, group)
        m = StoredMatrix(words, scales, biases, 4, group, transposed)
        x = rng.standard_normal((2, m.k_in)).astype(np.float32)
        assert np.array_equal(m(x, 1, arith=Arith.Q8), m(x, 1, arith=Arith.EXACT))


def test_q8_stays_close_to_the_float_arithmetic():
    """The activations' rounding is the only difference: on normal inputs the outputs move by far less
    than the weights' own quantization (a sanity bound; quality is measured on text elsewhere)."""
    rng = np.random.default_rng(9)
    _, words, scales, biases = quantized(rng, 256, 1024, 4, 32)
    m = StoredMatrix(words, scales, biases, 4, 32)
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    exact, q8 = m(x, 2), m(x, 2, arith=Arith.Q8)
    assert 0 < np.abs(q8 - exact).max() / np.abs(exact).max() < 2e-2


def test_every_level_is_listed_and_the_cpu_runs_at_least_portable():
    assert Isa.PORTABLE in LEVELS
    assert all(isinstance(level, Isa) for level in LEVELS)
