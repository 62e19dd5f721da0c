"""A gated FFN layer in one call (kernels/cpu/gated_ffn.cpp), as the MLX primitive and the torch
operator: equal to the bit to the separate products and activation it replaces, close to the plain-ops
reference (pointwise_ref.gated_ffn_ref), for gate|up as one matrix or two, affine and GGUF block
kinds, down stored either way round; a malformed matrix is refused in one line."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.kernels import mlx_kernels
from mlx_flash.kernels.blockmatmul import BlockMatrix
from mlx_flash.kernels.gguf_blocks_ref import dequantize as dequantize_blocks
from mlx_flash.kernels.pointwise_ref import gated_ffn_ref
from mlx_flash.kernels.qmatmul import StoredMatrix
from mlx_flash.kernels.qmatmul_ref import dequantize

from kernel_vectors import quantized, random_bytes

D, F = 128, 96


def _affine(rng, rows, cols, bits, rows_are_outputs=True):
    """(StoredMatrix, its dense [out, in] float64 matrix)."""
    if rows_are_outputs:
        _, w, s, b = quantized(rng, rows, cols, bits, 32)
        return StoredMatrix(w, s, b, bits, 32), dequantize(w, s, b, bits, 32)
    _, w, s, b = quantized(rng, cols, rows, bits, 32)  # stored [in, out]: rows are inputs
    return StoredMatrix(w, s, b, bits, 32, rows_are_outputs=False), dequantize(w, s, b, bits, 32).T


def _blocks(rows, cols, kind, seed):
    raw = random_bytes(kind, rows, cols, seed=seed)
    return BlockMatrix(raw, kind), dequantize_blocks(raw, kind)


def layer(case: str):
    """(gate, up or None, down) stored matrices and the dense gate|up [2F, D], down [D, F]."""
    rng = np.random.default_rng(len(case))
    if case == "fused-4bit":
        gu, gu_d = _affine(rng, 2 * F, D, 4)
        dn, dn_d = _affine(rng, D, F, 4)
        return (gu, None, dn), gu_d, dn_d
    if case == "two-8bit-down-by-inputs":
        g, g_d = _affine(rng, F, D, 8)
        u, u_d = _affine(rng, F, D, 8)
        dn, dn_d = _affine(rng, D, F, 8, rows_are_outputs=False)
        return (g, u, dn), np.concatenate([g_d, u_d]), dn_d
    if case == "two-q4k-down-q6k":  # widths of whole 256-value blocks
        g, g_d = _blocks(256, 256, "Q4_K", 1)
        u, u_d = _blocks(256, 256, "Q4_K", 2)
        dn, dn_d = _blocks(256, 256, "Q6_K", 3)
        return (g, u, dn), np.concatenate([g_d, u_d]), dn_d
    raise ValueError(case)


CASES = ["fused-4bit", "two-8bit-down-by-inputs", "two-q4k-down-q6k"]


def _inputs(case, T):
    (g, u, dn), gu_d, dn_d = layer(case)
    x = np.random.default_rng(T).standard_normal((1, T, g.k_in)).astype(np.float32)
    return (g, u, dn), gu_d, dn_d, x


def _pieces(x, g, u, dn):
    """The separate calls the fused one replaces, on the same kernels (numpy path)."""
    x2 = x.reshape(-1, x.shape[-1])
    if u is None:
        both = g(x2, 2)
        gate, up = both[:, : both.shape[1] // 2], both[:, both.shape[1] // 2 :]
    else:
        gate, up = g(x2, 2), u(x2, 2)
    with np.errstate(over="ignore"):  # random block bytes make some gates large: silu of them is 0
        h = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
    return h, dn(np.ascontiguousarray(h), 2)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_mlx_primitive_equals_the_separate_nodes_and_the_reference(case, T):
    (g, u, dn), gu_d, dn_d, x = _inputs(case, T)
    gg, gu_, gd = (mlx_kernels.GraphMatrix(m, 2) if m is not None else None for m in (g, u, dn))
    xa = mx.array(x)
    fused = mlx_kernels.gated_ffn(xa, gg, gu_, gd)
    if gu_ is None:
        both = gg(xa)
        gate, up = mx.split(both, 2, axis=-1)
    else:
        gate, up = gg(xa), gu_(xa)
    pieces = gd(mlx_kernels.silu_mul(gate, up))
    assert fused.shape == (1, T, dn.n_out)
    assert np.array_equal(np.array(fused), np.array(pieces))
    ref = gated_ffn_ref(x[0], gu_d, dn_d)
    np.testing.assert_allclose(np.array(fused)[0], ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_torch_operator_equals_the_separate_calls(case, T):
    torch = pytest.importorskip("torch")
    from mlx_flash.kernels import torch_ops

    (g, u, dn), gu_d, dn_d, x = _inputs(case, T)
    tg, tu, td = (torch_ops.TorchMatrix(m, 2) if m is not None else None for m in (g, u, dn))
    y = torch_ops.TorchMatrix.gated_ffn(torch.from_numpy(x), tg, tu, td)
    if tu is None:
        gate, up = torch.chunk(tg(torch.from_numpy(x)), 2, dim=-1)
    else:
        gate, up = tg(torch.from_numpy(x)), tu(torch.from_numpy(x))
    pieces = td(tg.ops.silu_mul(gate, up))
    assert y.shape == (1, T, dn.n_out)
    assert np.array_equal(y.numpy(), pieces.numpy())
    _, by_numpy = _pieces(x, g, u, dn)  # and the numpy path of the same kernels
    np.testing.assert_allclose(y.numpy()[0], by_numpy, rtol=1e-5, atol=1e-5 * np.abs(by_numpy).max())


def test_a_malformed_matrix_is_refused_in_one_line():
    torch = pytest.importorskip("torch")
    from mlx_flash.kernels import torch_ops

    (g, u, dn), *_ = layer("fused-4bit")
    tg, td = torch_ops.TorchMatrix(g, 2), torch_ops.TorchMatrix(dn, 2)
    x = torch.zeros(1, 1, D)
    with pytest.raises(RuntimeError, match="a matrix is 10 ints"):
        tg.ops.gated_ffn(x, tg.buffer, tg.spec[:5], tg.buffer, [], td.buffer, td.spec, 2)
    odd = list(tg.spec)
    odd[7] -= 1  # gate|up of an odd width
    with pytest.raises(RuntimeError, match="odd number"):
        tg.ops.gated_ffn(x, tg.buffer, odd, tg.buffer, [], td.buffer, td.spec, 2)
    with pytest.raises(ValueError, match="a matrix is 10 ints"):
        mlx_kernels.extension().gated_ffn(
            mx.zeros((1, D)),
            mx.zeros((8,), mx.uint8),
            [0, 1],
            mx.zeros((8,), mx.uint8),
            [],
            mx.zeros((8,), mx.uint8),
            [0, 1],
            2,
        )


def test_fake_implementation_passes_torch_operator_checks():
    torch = pytest.importorskip("torch")
    from mlx_flash.kernels import torch_ops

    (g, u, dn), *_ = layer("fused-4bit")
    tg, td = torch_ops.TorchMatrix(g, 2), torch_ops.TorchMatrix(dn, 2)
    x = torch.randn(2, D)
    torch.library.opcheck(
        torch.ops.mlx_flash.gated_ffn,
        (x, tg.buffer, tg.spec, tg.buffer, [], td.buffer, td.spec, 2),
        test_utils=("test_schema", "test_faketensor"),
    )


SPARSE = [(32, 4, 32, 4, None), (1, 8, 64, 4, 32)]  # (block, bits, group, down bits, down group): both down layouts


def _slab(block, bits, group, down_bits, down_group):
    from mlx_flash.kernels.slab_spec import ScaleType
    from mlx_flash.kernels.sparse_ffn import CpuSparseFFN
    from mlx_flash.kernels.sparse_ffn_ref import random_slab

    rng = np.random.default_rng(block + bits)
    D = 256 if block > 1 else 384
    slab, spec = random_slab(rng, 24, D, block, bits, group, ScaleType.F16, down_bits, down_group, pad=12)
    return CpuSparseFFN(spec, 2).matrices(slab), D, rng


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("layout", SPARSE)
def test_sparse_layer_in_one_call_equals_the_separate_sparse_products(layout, T):
    (g, u, dn), D, rng = _slab(*layout)
    x = rng.standard_normal((T, D)).astype(np.float32)
    for count in (1, 7, 24):
        idx = np.ascontiguousarray(rng.permutation(24)[:count], dtype=np.int32)
        gm, um, dm = (mlx_kernels.GraphMatrix(m, 2) for m in (g, u, dn))
        ids = mx.array(idx)
        fused = mlx_kernels.gated_ffn(mx.array(x), gm, um, dm, ids, count)
        pieces = dm.sparse(
            mlx_kernels.silu_mul(gm.sparse(mx.array(x), ids, count), um.sparse(mx.array(x), ids, count)), ids, count
        )
        assert np.array_equal(np.array(fused), np.array(pieces)), count
        try:
            import torch
        except ImportError:
            continue
        from mlx_flash.kernels import torch_ops

        tg, tu, td = (torch_ops.TorchMatrix(m, 2) for m in (g, u, dn))
        tids, tx = torch.from_numpy(idx), torch.from_numpy(x)
        y = torch_ops.TorchMatrix.gated_ffn(tx, tg, tu, td, tids, count)
        h = tg.ops.silu_mul(tg.sparse(tx, tids, count), tu.sparse(tx, tids, count))
        assert np.array_equal(y.numpy(), td.sparse(h, tids, count).numpy()), count
        assert np.array_equal(y.numpy(), np.array(fused)), count  # one kernel under both frameworks
