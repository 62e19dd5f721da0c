"""A MoE layer's routed experts in one call (kernels/cpu/moe_experts.cpp), as the MLX primitive and the
torch operator: equal to the bit to one gated-FFN call per expert over its gathered tokens, summed in
ascending expert order (what models/moe.py does without it), close to the plain-ops reference
(pointwise_ref.moe_experts_ref), for affine and GGUF block kinds, gate|up fused or apart; experts left
out of a call add nothing, so waves add up to the whole; a malformed table is refused in one line."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.kernels import mlx_kernels
from mlx_flash.kernels.blockmatmul import BlockMatrix
from mlx_flash.kernels.gguf_blocks_ref import dequantize as dequantize_blocks
from mlx_flash.kernels.pointwise_ref import moe_experts_ref
from mlx_flash.kernels.qmatmul import StoredMatrix
from mlx_flash.kernels.qmatmul_ref import dequantize

from kernel_vectors import quantized, random_bytes

E, K = 6, 2


def one_buffer(*arrays):
    """Copies of `arrays` side by side in one uint8 buffer (64-byte aligned each), as views of it: an
    expert's parts lie in one buffer in a store's bundle rows, as the grouped kernel takes them."""
    at, size = [], 0
    for a in arrays:
        at.append(size)
        size += -(-a.nbytes // 64) * 64
    buf = np.zeros(size, np.uint8)
    views = []
    for a, o in zip(arrays, at):
        buf[o : o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        views.append(buf[o : o + a.nbytes].view(a.dtype).reshape(a.shape))
    return views


def expert(case: str, seed: int, D: int, F: int):
    """(gate, up or None, down) stored matrices in one buffer, and the dense gate|up [2F, D], down [D, F]."""
    rng = np.random.default_rng(seed)
    if case == "fused-4bit":
        _, gw, gs, gb = quantized(rng, 2 * F, D, 4, 32)
        _, dw, ds, db = quantized(rng, D, F, 4, 32)
        gw, gs, gb, dw, ds, db = one_buffer(gw, gs, gb, dw, ds, db)
        mats = (StoredMatrix(gw, gs, gb, 4, 32), None, StoredMatrix(dw, ds, db, 4, 32))
        return mats, dequantize(gw, gs, gb, 4, 32), dequantize(dw, ds, db, 4, 32)
    if case == "two-8bit":
        parts = [quantized(rng, r, c, 8, 32)[1:] for r, c in ((F, D), (F, D), (D, F))]
        flat = one_buffer(*[p for trio in parts for p in trio])
        mats = tuple(StoredMatrix(*flat[3 * i : 3 * i + 3], 8, 32) for i in range(3))
        dense = [dequantize(*flat[3 * i : 3 * i + 3], 8, 32) for i in range(3)]
        return mats, np.concatenate(dense[:2]), dense[2]
    kinds = {"two-q5_1-down-q5_0": ("Q5_1", "Q5_0"), "two-q4k-down-q6k": ("Q4_K", "Q6_K")}[case]
    raws = one_buffer(
        random_bytes(kinds[0], F, D, seed),
        random_bytes(kinds[0], F, D, seed + 1),
        random_bytes(kinds[1], D, F, seed + 2),
    )
    mats = (BlockMatrix(raws[0], kinds[0]), BlockMatrix(raws[1], kinds[0]), BlockMatrix(raws[2], kinds[1]))
    dense = [dequantize_blocks(r, k) for r, k in zip(raws, (kinds[0], kinds[0], kinds[1]))]
    return mats, np.concatenate(dense[:2]), dense[2]


CASES = ["fused-4bit", "two-8bit", "two-q5_1-down-q5_0", "two-q4k-down-q6k"]


def layer(case: str, N: int):
    D, F = (256, 256) if "q4k" in case else (128, 96)
    experts = [expert(case, 10 * e + 1, D, F) for e in range(E)]
    rng = np.random.default_rng(N)
    x = rng.standard_normal((N, D)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    wts = rng.random((N, K)).astype(np.float32)
    return experts, x, ids, wts, D


def graph(experts) -> dict:
    """id -> the expert's (gate, up or None, down) as MLX operations."""
    return {
        e: tuple(None if m is None else mlx_kernels.GraphMatrix(m, 2) for m in mats)
        for e, (mats, _, _) in enumerate(experts)
    }


def per_expert_mlx(x, ids, wts, experts, threads=2):
    """One gated_ffn node per routed expert over its gathered tokens, added in ascending order."""
    out = mx.zeros((len(x), experts[0][0][2].n_out))
    xa = mx.array(x)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        r = mx.array(rows.astype(np.int32))
        g, u, d = (None if m is None else mlx_kernels.GraphMatrix(m, threads) for m in experts[e][0])
        y = mlx_kernels.gated_ffn(xa[r], g, u, d)
        out = out.at[r].add(y * mx.array(wts[rows, slot]).reshape(-1, 1))
    return np.array(out)


@pytest.mark.parametrize("N", [1, 5])
@pytest.mark.parametrize("case", CASES)
def test_mlx_primitive_equals_one_call_per_expert_and_the_reference(case, N):
    experts, x, ids, wts, D = layer(case, N)
    y = mlx_kernels.moe_experts(mx.array(x), mx.array(ids), mx.array(wts), mx.zeros((N, D)), graph(experts), E, 2)
    got = np.array(y)
    assert np.array_equal(got, per_expert_mlx(x, ids, wts, experts))
    ref = moe_experts_ref(x, ids, wts, {e: (gu, dn) for e, (_, gu, dn) in enumerate(experts)})
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


def test_mlx_waves_add_up_to_the_whole():
    experts, x, ids, wts, D = layer("two-q5_1-down-q5_0", 7)
    mats = graph(experts)
    args = (mx.array(x), mx.array(ids), mx.array(wts))
    whole = mlx_kernels.moe_experts(*args, mx.zeros((7, D)), mats, E, 2)
    total = mx.zeros((7, D))
    for wave in ([0, 1], [2, 3, 4], [5]):
        total = mlx_kernels.moe_experts(*args, total, {e: mats[e] for e in wave}, E, 2)
    assert np.array_equal(np.array(total), np.array(whole))


@pytest.mark.parametrize("N", [1, 5])
@pytest.mark.parametrize("case", CASES)
def test_torch_operator_equals_the_mlx_primitive(case, N):
    torch = pytest.importorskip("torch")
    from mlx_flash.kernels import torch_ops

    experts, x, ids, wts, D = layer(case, N)
    mats = {
        e: tuple(None if m is None else torch_ops.TorchMatrix(m, 2) for m in ms) for e, (ms, _, _) in enumerate(experts)
    }
    t = torch_ops.moe_experts(
        torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(wts), torch.zeros(N, D), mats, E, 2
    )
    m = mlx_kernels.moe_experts(mx.array(x), mx.array(ids), mx.array(wts), mx.zeros((N, D)), graph(experts), E, 2)
    assert np.array_equal(t.numpy(), np.array(m))  # the same kernel on the same bytes


def test_a_malformed_table_is_refused_in_one_line():
    torch = pytest.importorskip("torch")
    from mlx_flash.kernels import torch_ops

    experts, x, ids, wts, D = layer("two-q5_1-down-q5_0", 3)
    ops = torch_ops.ops()
    args = (torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(wts), torch.zeros(3, D))
    with pytest.raises(RuntimeError, match="the table ends inside") as e:
        ops.moe_experts(*args, [torch.zeros(16, dtype=torch.uint8)], [1, 0, 9, 1, 2], 2)
    assert "\n" not in str(e.value).split("\nException raised from")[0]
    with pytest.raises(RuntimeError, match="buffer index is past"):
        ops.moe_experts(*args, [], [1, 3, 0, -1, 0, -1, 0], 2)
    with pytest.raises(ValueError, match="x \\[N, D\\], ids and weights \\[N, K\\]"):
        mlx_kernels.extension().moe_experts(
            mx.array(x), mx.array(ids[:2]), mx.array(wts), mx.zeros((3, D)), [], [[(-1, [])] * 3], 2
        )
