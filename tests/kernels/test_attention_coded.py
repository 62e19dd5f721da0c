"""Attention over compressed KV (kernels/cpu/attention.cpp mf_attention_coded, as the MLX primitive
and the torch operator): keys and values read as codes through a layout (kernels/kv_codes.py),
dequantized a block at a time inside the kernel. Each case equals the float kernel run over the
dequantized keys and values bit for bit, and the float64 reference closely, on every code path this
CPU runs: the throughput mode's 4-bit rows (keys per channel over blocks of 16 tokens with a float
tail, values per token), the service's chunk pool through a slot table, 8/4/2 bits, grouped heads,
a prompt and a decode step."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlx_flash.kernels import mlx_kernels, torch_ops
from mlx_flash.kernels.attention_ref import attention_ref, coded_rows
from mlx_flash.kernels.kv_codes import from_views
from mlx_flash.kernels.qmatmul import float_paths, use_isa
from mlx_flash.models.kv_quant import dequantize, quantize

RUNNABLE = float_paths()  # the float arithmetic's loops
BLOCK = 16


def _kivi_row(rng, H, n, hd, bits, group):
    """One sequence's keys and values as the throughput mode's QuantizedKV holds them: keys per channel
    over complete blocks of BLOCK tokens plus a float tail, values per token in groups of `group`.
    Returns the codes' buffers and layouts, the float tail, the identity slot table and the counts."""
    full = n // BLOCK
    blocks = full + 1
    k = rng.standard_normal((H, blocks * BLOCK, hd)).astype(np.float32)
    v = rng.standard_normal((H, blocks * BLOCK, hd)).astype(np.float32)
    kc, ks, kb = quantize(np.ascontiguousarray(k.reshape(H, blocks, BLOCK, hd).transpose(0, 1, 3, 2)), bits, BLOCK)
    vc, vs, vb = quantize(v, bits, group)  # [H, tokens, hd / per], [H, tokens, hd / group]
    kbuf, kl = from_views(
        kc.transpose(1, 0, 3, 2), *(a[..., 0].transpose(1, 0, 2)[:, :, None, :] for a in (ks, kb)), bits, "tokens",
        BLOCK, 1, BLOCK,
    )  # fmt: skip
    per_block = (blocks, BLOCK)
    vbuf, vl = from_views(
        *(a.reshape(H, *per_block, a.shape[-1]).transpose(1, 0, 2, 3) for a in (vc, vs, vb)), bits, "channels", 1,
        group, BLOCK,
    )  # fmt: skip
    tail = k[None, :, full * BLOCK : (full + 1) * BLOCK].copy()  # the incomplete block, exact
    table = np.arange(blocks, dtype=np.int32)[None]
    coded = np.array([[full * BLOCK], [n]], np.int32)
    return kbuf, kl, vbuf, vl, tail, table, coded


def _both(q, res_k, res_v, scale, threads, kbuf, kl, vbuf, vl, coded, kv_len, q_pos, table=None):
    """The MLX primitive's and the torch operator's results."""
    y_mlx = mlx_kernels.attention_coded(
        mx.array(q), mx.array(res_k), mx.array(res_v), scale, threads, mx.array(kbuf), kl, mx.array(vbuf), vl,
        mx.array(coded), mx.array(kv_len), mx.array(q_pos), None if table is None else mx.array(table),
    )  # fmt: skip
    t = torch.from_numpy
    y_torch = torch_ops.ops().attention_coded(
        t(q), t(res_k), t(res_v), scale, threads, t(kbuf), kl.ints(), t(vbuf), vl.ints(), t(coded), t(kv_len),
        t(q_pos), None if table is None else t(table),
    )  # fmt: skip
    return np.array(y_mlx), y_torch.numpy()


def _float_kernel(q, kf, vf, scale, kv_len, q_pos):
    return np.array(
        mlx_kernels.attention(mx.array(q), mx.array(kf), mx.array(vf), scale, 1, mx.array(kv_len), mx.array(q_pos))
    )


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("T,n", [(1, 37), (5, 40), (1, 16)])
def test_the_throughput_modes_rows_equal_the_float_kernel_over_their_dequantized_values(bits, T, n, isa_restored):
    rng = np.random.default_rng(bits * 100 + n)
    Hq, H, hd = 6, 2, 64
    kbuf, kl, vbuf, vl, tail, table, coded = _kivi_row(rng, H, n, hd, bits, 32)
    kv_len, q_pos = np.array([n], np.int32), np.array([n - T], np.int32)
    q = rng.standard_normal((1, Hq, T, hd)).astype(np.float32)
    kf = coded_rows(kbuf, kl, coded[0], tail, kv_len, table)
    vf = coded_rows(vbuf, vl, coded[1], tail, kv_len, table)
    ref = attention_ref(q, kf, vf, hd**-0.5, kv_len, q_pos)
    for isa in RUNNABLE:  # each instruction set's float kernel rounds its own way: compare within one
        use_isa(isa)
        want = _float_kernel(q, kf, vf, hd**-0.5, kv_len, q_pos)
        assert np.abs(want - ref).max() < 2e-5 * max(1.0, np.abs(ref).max())
        for threads in (1, 2):
            for y in _both(q, tail, tail, hd**-0.5, threads, kbuf, kl, vbuf, vl, coded, kv_len, q_pos, table):
                assert np.array_equal(y, want), f"{isa.name}, {threads} threads: max diff {np.abs(y - want).max()}"


def test_the_layouts_read_what_kv_quant_dequantizes():
    """The reference reading (CodedLayout.dequantize) against models/kv_quant.py for both groupings:
    what makes 'equal to the float kernel over the dequantized values' mean the service's numbers."""
    rng = np.random.default_rng(1)
    H, n, hd, bits = 2, 48, 32, 4
    kbuf, kl, vbuf, vl, tail, table, coded = _kivi_row(rng, H, n, hd, bits, 16)
    blocks = table.shape[1]
    keys = kl.dequantize(kbuf, blocks, H, BLOCK, hd)  # [blocks, H, BLOCK, hd]
    values = vl.dequantize(vbuf, blocks, H, BLOCK, hd)
    # rebuild the codes the way _kivi_row made them, from the same random draws
    rng = np.random.default_rng(1)
    k = rng.standard_normal((H, blocks * BLOCK, hd)).astype(np.float32)
    v = rng.standard_normal((H, blocks * BLOCK, hd)).astype(np.float32)
    kq = dequantize(*quantize(np.ascontiguousarray(k.reshape(H, blocks, BLOCK, hd).transpose(0, 1, 3, 2)), bits, BLOCK),
                    bits, BLOCK)  # fmt: skip
    assert np.array_equal(keys, kq.transpose(1, 0, 3, 2))
    vq = dequantize(*quantize(v, bits, 16), bits, 16)
    assert np.array_equal(values, vq.reshape(H, blocks, BLOCK, hd).transpose(1, 0, 2, 3))
    assert np.abs(values - v.reshape(H, blocks, BLOCK, hd).transpose(1, 0, 2, 3)).max() > 0  # codes, not floats


def test_a_chunk_pool_through_a_slot_table_with_float16_residuals():
    """The service's layout: chunks of 32 tokens in a pool (keys per channel over the chunk, values per
    token), named per row by a slot table; each row's current chunk a float16 residual."""
    rng = np.random.default_rng(2)
    B, Hq, H, hd, bt, bits, T = 2, 8, 2, 64, 32, 4, 3
    pool = 5
    k = rng.standard_normal((pool, H, bt, hd)).astype(np.float32)
    v = rng.standard_normal((pool, H, bt, hd)).astype(np.float32)
    kc, ks, kb = quantize(np.ascontiguousarray(k.transpose(0, 1, 3, 2)), bits, bt)  # [pool, H, hd, bt/2]
    kbuf, kl = from_views(kc.transpose(0, 1, 3, 2), ks.transpose(0, 1, 3, 2), kb.transpose(0, 1, 3, 2), bits,
                          "tokens", bt, 1, bt)  # fmt: skip
    vc, vs, vb = quantize(v, bits, 32)
    vbuf, vl = from_views(vc, vs, vb, bits, "channels", 1, 32, bt)
    table = np.array([[3, 0, 4], [1, 2, 0]], np.int32)
    coded = np.array([[64, 32], [64, 32]], np.int32)
    kv_len = np.array([64 + 9, 32 + 20], np.int32)
    q_pos = kv_len - T
    res = rng.standard_normal((B, H, 24, hd)).astype(np.float16)
    q = rng.standard_normal((B, Hq, T, hd)).astype(np.float32)
    kf = coded_rows(kbuf, kl, coded[0], res.astype(np.float32), kv_len, table)
    vf = coded_rows(vbuf, vl, coded[1], res.astype(np.float32), kv_len, table)
    want = _float_kernel(q, kf, vf, 0.125, kv_len, q_pos)
    for y in _both(q, res, res, 0.125, 2, kbuf, kl, vbuf, vl, coded, kv_len, q_pos, table):
        assert np.array_equal(y, want)


def test_a_broken_layout_fails_the_comparison():
    """The check can fail: values read with every channel group taking the first group's scale differ."""
    rng = np.random.default_rng(3)
    kbuf, kl, vbuf, vl, tail, table, coded = _kivi_row(rng, 2, 40, 64, 4, 32)
    kv_len, q_pos = np.array([40], np.int32), np.array([39], np.int32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    kf = coded_rows(kbuf, kl, coded[0], tail, kv_len, table)
    vf = coded_rows(vbuf, vl, coded[1], tail, kv_len, table)
    want = _float_kernel(q, kf, vf, 0.125, kv_len, q_pos)
    ss = vl.scale_strides
    broken = type(vl)(**{**vl.__dict__, "scale_strides": (ss[0], ss[1], ss[2], 0)})
    y, _ = _both(q, tail, tail, 0.125, 1, kbuf, kl, vbuf, broken, coded, kv_len, q_pos, table)
    assert not np.array_equal(y, want)


@pytest.mark.parametrize(
    "change, code",
    [
        ({"bits": 3}, -4),
        ({"codes": 10**6}, -6),
        ({"scale_strides": (0, 0, 0, -1)}, -5),
        ({"counts": [[41], [40]]}, -7),
        ({"table": [[0, -1, 2]]}, -8),
    ],
)
def test_refuses_a_layout_outside_its_buffer_or_counts_outside_the_row(change, code):
    rng = np.random.default_rng(4)
    kbuf, kl, vbuf, vl, tail, table, coded = _kivi_row(rng, 2, 40, 64, 4, 32)
    kv_len, q_pos = np.array([40], np.int32), np.array([39], np.int32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    fields = {k: v for k, v in change.items() if k in vl.__dict__}
    vl = type(vl)(**{**vl.__dict__, **fields})
    coded = np.array(change.get("counts", coded), np.int32)
    table = np.array(change.get("table", table), np.int32)
    with pytest.raises(RuntimeError, match=rf"attention_coded.*refused its arguments \(code {code}\)"):
        torch_ops.ops().attention_coded(
            *(torch.from_numpy(a) for a in (q, tail, tail)), 0.125, 1, torch.from_numpy(kbuf), kl.ints(),
            torch.from_numpy(vbuf), vl.ints(), *(torch.from_numpy(a) for a in (coded, kv_len, q_pos, table)),
        )  # fmt: skip
    y = mlx_kernels.attention_coded(
        *(mx.array(a) for a in (q, tail, tail)), 0.125, 1, mx.array(kbuf), kl, mx.array(vbuf), vl,
        *(mx.array(a) for a in (coded, kv_len, q_pos, table)),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=rf"CodedAttention.*refused its arguments \(code {code}\)"):
        mx.eval(y)


def test_a_layout_of_another_length_is_one_line():
    rng = np.random.default_rng(5)
    kbuf, kl, vbuf, vl, tail, table, coded = _kivi_row(rng, 2, 20, 32, 8, 32)
    t = torch.from_numpy
    args = [t(a) for a in (rng.standard_normal((1, 2, 1, 32)).astype(np.float32), tail, tail)]
    with pytest.raises(RuntimeError, match="a key layout is 15 ints"):
        torch_ops.ops().attention_coded(*args, 1.0, 1, t(kbuf), kl.ints()[:-1], t(vbuf), vl.ints(), t(coded),
                                        t(np.array([20], np.int32)), t(np.array([19], np.int32)), t(table))  # fmt: skip
