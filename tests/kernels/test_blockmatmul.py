"""The CPU block kernel (kernels/cpu/blockmatmul*.cpp) for GGUF block types kept as stored: the
reference dequantization equals the gguf package's bit for bit, and the kernel equals the reference
product on every code path this CPU runs, for plain matrices, rows inside a buffer of bundles, listed
rows and blocks, token counts across the 4-token tile and thread counts; bad layouts are refused."""

import numpy as np
import pytest

from mlx_flash.convert.gguf_quantize import quantize_k
from mlx_flash.kernels.blockmatmul import BlockMatrix
from mlx_flash.kernels.gguf_blocks_ref import BLOCKS, block_matmul_ref, dequantize
from mlx_flash.kernels.qmatmul import float_paths, use_isa

from kernel_vectors import random_bytes

gguf = pytest.importorskip("gguf")
RUNNABLE = float_paths()  # the float arithmetic's loops
KINDS = list(BLOCKS)


def blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Realistic rows of `kind`: float rows quantized (gguf's quantizer for Q5_0/Q5_1, ours for the
    k-quants, which gguf lacks), the weights of various scales so sub-block scales differ."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 1.0, (rows, cols // 16)).repeat(16, axis=1)
    w = w.astype(np.float32)
    if kind in ("Q5_0", "Q5_1"):
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    return quantize_k(w, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [blocks, random_bytes])
def test_dequantization_equals_gguf_bit_for_bit(kind, make):
    raw = make(kind, 6, 512, seed=3)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    got = dequantize(raw, kind)
    assert got.dtype == np.float32 and got.shape == (6, 512)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_our_k_quantizer_round_trips_within_its_bits(kind):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((16, 1024)).astype(np.float32)
    back = dequantize(quantize_k(w, kind), kind)
    rms = np.sqrt(((back - w) ** 2).mean()) / w.std()
    assert rms < {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.025}[kind], f"{kind}: relative RMS error {rms:.4f}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_kernel_equals_reference_on_every_path(kind, tokens, isa_restored):
    raw = random_bytes(kind, 70, 768 if BLOCKS[kind].weights == 256 else 96, seed=tokens)
    x = np.random.default_rng(5).standard_normal((tokens, raw.shape[1] // BLOCKS[kind].nbytes * BLOCKS[kind].weights))
    x = x.astype(np.float32)
    ref = block_matmul_ref(x, raw, kind)
    m = BlockMatrix(raw, kind)
    for isa in RUNNABLE:
        use_isa(isa)
        for threads in (1, 2, 3):
            y = m(x, threads)
            rel = np.abs(y - ref).max() / np.abs(ref).max()
            assert rel < 2e-6, f"{kind} {isa.name} threads={threads}: relative error {rel:.2e}"


def test_rows_inside_a_buffer_of_bundles(isa_restored):
    """Gate-like rows (blocks of rows, one block per bundle) and a down-like matrix (its blocks are
    the bundles) read where they lie, as the FFN's bundles hold them, padded rows included."""
    kind, blk = "Q4_K", BLOCKS["Q4_K"]
    nb, per, D = 3, 4, 8  # bundles, rows per bundle, down rows
    gate = random_bytes(kind, nb * per, 512, seed=7)  # [12, 288]
    down = random_bytes(kind, D, nb * 256, seed=8)  # [8, 3 blocks]
    width = 300  # the field's row stride: wider than a row (a layer padded to a wider type)
    gate_at, down_at = 16, 16 + per * width
    bb = down_at + D * blk.nbytes + 8
    buf = np.zeros((nb, bb), np.uint8)
    for b in range(nb):
        for r in range(per):
            buf[b, gate_at + r * width : gate_at + r * width + gate.shape[1]] = gate[b * per + r]
        for d in range(D):
            buf[b, down_at + d * blk.nbytes : down_at + (d + 1) * blk.nbytes] = down[
                d, b * blk.nbytes : (b + 1) * blk.nbytes
            ]
    g = BlockMatrix.in_buffer(buf, gate_at, kind, nb * per, 512, per, bb, width, blk.nbytes)
    dn = BlockMatrix.in_buffer(buf, down_at, kind, D, nb * 256, D, 0, blk.nbytes, bb)
    rng = np.random.default_rng(9)
    x, h = rng.standard_normal((2, 512)).astype(np.float32), rng.standard_normal((2, nb * 256)).astype(np.float32)
    for isa in RUNNABLE:
        use_isa(isa)
        assert np.allclose(g(x, 2), block_matmul_ref(x, gate, kind), rtol=1e-5, atol=1e-5)
        assert np.allclose(dn(h, 2), block_matmul_ref(h, down, kind), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="past its buffer"):
        BlockMatrix.in_buffer(buf, down_at, kind, D, (nb + 1) * 256, D, 0, blk.nbytes, bb)


def test_bad_matrices_are_refused():
    raw = random_bytes("Q6_K", 4, 256)
    with pytest.raises(ValueError, match="not one of"):
        BlockMatrix(raw, "Q2_K")
    with pytest.raises(ValueError, match="whole 210-byte blocks"):
        BlockMatrix(raw[:, :200], "Q6_K")
    with pytest.raises(ValueError, match="2-D uint8"):
        BlockMatrix(raw.view(np.int8), "Q6_K")
    m = BlockMatrix(raw, "Q6_K")
    with pytest.raises(ValueError, match=r"x must be \[T, 256\]"):
        m(np.zeros((1, 128), np.float32))
    with pytest.raises(ValueError, match="float32"):
        m(np.zeros((1, 256), np.float64))
    assert np.array_equal(m.rows(np.array([2, 0])), dequantize(raw[[2, 0]], "Q6_K"))
