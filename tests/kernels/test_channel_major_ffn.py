"""A gated FFN layer of channel-major products in one call (kernels/cpu/channel_major_ffn.cpp): the C
function (channel_major.gated_ffn), the torch operator (torch_ops.cm_gated_ffn) and the MLX primitive
(mlx_kernels.cm_gated_ffn) each equal to the bit to the three separate calls it replaces (the product
over gate|up, the activation as the existing kernels compute it, the product over down), with each
matrix's counters as the separate calls count them; one row and several, thresholds zero, positive
and negative (dense), gate|up as one matrix or two, SwiGLU and GeGLU; close to a plain-ops
reference; bad arguments refused with a reason."""

import ctypes
import importlib.util

import numpy as np
import pytest

from mlx_flash.kernels import channel_major
from mlx_flash.kernels.channel_major import ChannelMajorMatrix, CmArgs, _lib
from mlx_flash.kernels.channel_major_ref import cm_matmul_ref
from mlx_flash.kernels.qmatmul import StoredMatrix, library

from kernel_vectors import quantized

# F = 1056: gate|up 2112 outputs (33 steps of 64: a narrow last tile), and F / 2 >= 512, so 2 threads
# split the activations; D = 160 (padded to 192)
D, F = 160, 1056
THRESHOLDS = [(-1.0, -1.0), (0.0, 0.0), (0.5, 0.02), (0.5, -1.0), (-1.0, 0.02)]  # (t_gu, t_down)

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")


def _matrix(rng, n, k, bits, buffer=None):
    _, w, s, b = quantized(rng, n, k, bits, 32)
    return ChannelMajorMatrix.from_stored(StoredMatrix(w, s, b, bits, 32), buffer), (w, s, b, bits)


def layer(two: bool = False, buffer=None, seed: int = 0):
    """(gate_up or gate, down, up or None, the stored parts of each for the reference)."""
    rng = np.random.default_rng(seed)
    gu, gu_parts = _matrix(rng, F if two else 2 * F, D, 4, buffer)
    up, up_parts = _matrix(rng, F, D, 4, buffer) if two else (None, None)
    dn, dn_parts = _matrix(rng, D, F, 8, buffer)  # down at another width: each matrix its own
    return gu, dn, up, (gu_parts, up_parts, dn_parts)


def act_mul(name: str, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The library's activation (mf_silu_mul or mf_gelu_tanh_mul) over contiguous g and u."""
    g, u = np.ascontiguousarray(g, np.float32), np.ascontiguousarray(u, np.float32)
    fn = getattr(library(), "mf_silu_mul" if name == "silu" else "mf_gelu_tanh_mul")
    out = np.empty_like(g)
    assert (
        fn(
            ctypes.c_void_p(g.ctypes.data),
            ctypes.c_void_p(u.ctypes.data),
            ctypes.c_int64(g.size),
            ctypes.c_void_p(out.ctypes.data),
        )
        == 0
    )
    return out


def separate(x, gu, dn, up, t_gu, t_down, act="silu", threads=2):
    """The three (or four) calls the fused one replaces, on the numpy path."""
    if up is None:
        both = gu.matmul(x, t_gu, threads=threads)
        g, u = both[:, :F], both[:, F:]
    else:
        g, u = gu.matmul(x, t_gu, threads=threads), up.matmul(x, t_gu, threads=threads)
    return dn.matmul(act_mul(act, g, u), t_down, threads=threads)


def counters_of(*ms):
    return [None if m is None else m.counters.copy() for m in ms]


def deltas(before, ms):
    return [None if m is None else m.counters - b for b, m in zip(before, ms)]


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("two", [False, True])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_the_c_function_equals_the_separate_calls(tokens, two, act):
    gu, dn, up, _ = layer(two)
    x = np.random.default_rng(tokens).standard_normal((tokens, D)).astype(np.float32)
    for t_gu, t_down in THRESHOLDS:
        before = counters_of(gu, up, dn)
        want = separate(x, gu, dn, up, t_gu, t_down, act)
        counted, before = deltas(before, (gu, up, dn)), counters_of(gu, up, dn)
        got = channel_major.gated_ffn(x, gu, dn, t_gu, t_down, up=up, act=act, threads=2)
        assert np.array_equal(got, want), (t_gu, t_down)
        for a, b in zip(deltas(before, (gu, up, dn)), counted):
            assert a is None and b is None or np.array_equal(a, b)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_close_to_the_plain_ops_reference(act):
    gu, dn, up, (gu_parts, _, dn_parts) = layer()
    x = np.random.default_rng(1).standard_normal((3, D)).astype(np.float32)
    for t_gu, t_down in THRESHOLDS:
        both = cm_matmul_ref(x, *gu_parts[:3], 4, 32, t_gu)
        g, u = both[:, :F], both[:, F:]
        if act == "silu":
            h = g / (1 + np.exp(-g)) * u
        else:
            h = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
        # the kernel thresholds its own float32 activations: near the threshold the reference may
        # keep a channel the kernel drops, so down is compared with the kernel's own mask
        got_h = act_mul(act, *np.split(gu.matmul(x, t_gu), 2, axis=1))
        assert np.abs(got_h - h).max() / np.abs(h).max() < 1e-5
        want = cm_matmul_ref(got_h, *dn_parts[:3], 8, 32, t_down)
        got = channel_major.gated_ffn(x, gu, dn, t_gu, t_down, act=act)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_bad_arguments_are_refused_with_a_reason():
    gu, dn, up, _ = layer(two=True)
    x = np.ones((2, D), np.float32)
    with pytest.raises(ValueError, match="act must be"):
        channel_major.gated_ffn(x, gu, dn, 0.0, 0.0, up=up, act="relu")
    with pytest.raises(ValueError, match="x must be"):
        channel_major.gated_ffn(np.ones((2, D + 1), np.float32), gu, dn, 0.0, 0.0, up=up)
    with pytest.raises(ValueError, match="NaN"):
        channel_major.gated_ffn(x, gu, dn, 0.0, float("nan"), up=up)
    with pytest.raises(ValueError, match="odd number of outputs"):
        channel_major.gated_ffn(x, up, dn, 0.0, 0.0, up=dn)  # gate F x D, "up" D x F
    with pytest.raises(ValueError, match="odd number of outputs"):
        channel_major.gated_ffn(x, layer(seed=1)[0], dn, 0.0, 0.0, up=up)  # gate 2F, up F
    with pytest.raises(ValueError, match="down's inputs"):
        channel_major.gated_ffn(x, gu, gu, 0.0, 0.0, up=up)
    # the library's own checks, for callers that reach it without a binding
    lib, y, h = _lib(), np.empty((2, D), np.float32), np.empty(4 * F, np.float32)
    g, u, d = (CmArgs(m._w, *m.spec) for m in (gu, up, dn))
    call = [
        x.ctypes.data,
        2,
        ctypes.byref(g),
        ctypes.byref(u),
        ctypes.byref(d),
        0.0,
        0.0,
        0,
        h.ctypes.data,
        y.ctypes.data,
        1,
        None,
        None,
        None,
    ]
    for at, value, code in ((1, -1, -7), (7, 2, -11), (8, None, -6), (4, None, -6)):
        args = list(call)
        args[at] = value
        assert lib.mf_cm_gated_ffn(*args) == code
    bad = CmArgs(dn._w, D, F, 3, 32, 0)
    assert lib.mf_cm_gated_ffn(*call[:4], ctypes.byref(bad), *call[5:]) == -1
    assert lib.mf_cm_gated_ffn(*call[:5], float("nan"), *call[6:]) == -8
    assert lib.mf_cm_gated_ffn(*call) == 0


@needs_torch
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("two", [False, True])
def test_the_torch_operator_equals_the_separate_operators(tokens, two):
    import torch

    from mlx_flash.kernels import torch_ops

    gu, dn, up, _ = layer(two, torch_ops.framework_buffer)
    ops_ = [None if m is None else torch_ops.TorchChannelMajor(m, 2) for m in (gu, up, dn)]
    o_gu, o_up, o_dn = ops_
    ops = torch_ops.ops()
    x = torch.from_numpy(np.random.default_rng(tokens).standard_normal((1, tokens, D)).astype(np.float32))

    def counts():
        return [None if o is None else (o.counters.clone(), o.dense_counters.clone()) for o in ops_]

    for t_gu, t_down in THRESHOLDS:
        before = counts()
        if two:
            g, u = o_gu(x, t_gu), o_up(x, t_gu)
        else:
            both = o_gu(x, t_gu)
            g, u = both[..., :F], both[..., F:]
        want = o_dn(ops.silu_mul(g, u), t_down)
        mid = counts()
        got = torch_ops.cm_gated_ffn(x, o_gu, o_dn, t_gu, t_down, up=o_up)
        after = counts()
        assert got.shape == (1, tokens, D) and torch.equal(got, want), (t_gu, t_down)
        for b, m, a in zip(before, mid, after):  # the fused call counted as the separate ones did
            assert b is None or all(torch.equal(m[i] - b[i], a[i] - m[i]) for i in (0, 1))
    g = torch_ops.cm_gated_ffn(x, o_gu, o_dn, 0.5, 0.02, up=o_up, act="gelu_tanh")
    assert np.array_equal(g.numpy().reshape(tokens, D), separate(x.numpy()[0], gu, dn, up, 0.5, 0.02, "gelu_tanh"))
    spec_up = () if up is None else o_up.spec
    args = (x, o_gu.buffer, o_gu.spec, o_gu.buffer, spec_up, o_dn.buffer, o_dn.spec, 0.5, 0.02, 0, 1)
    with pytest.raises(RuntimeError, match="down takes"):
        ops.cm_gated_ffn(*args[:5], o_gu.buffer, o_gu.spec, *args[7:])
    with pytest.raises(RuntimeError, match="x must be"):
        ops.cm_gated_ffn(torch.ones(1, D + 1), *args[1:])
    with pytest.raises(RuntimeError, match="act is 0"):
        ops.cm_gated_ffn(*args[:9], 7, 1)
    with pytest.raises(RuntimeError, match="NaN"):
        ops.cm_gated_ffn(*args[:7], float("nan"), *args[8:])
    with pytest.raises(RuntimeError, match="counters must be"):
        ops.cm_gated_ffn(*args, torch.zeros(3))
    with pytest.raises(ValueError, match="act must be"):
        torch_ops.cm_gated_ffn(x, o_gu, o_dn, 0.5, 0.02, up=o_up, act="relu")
    torch.library.opcheck(ops.cm_gated_ffn.default, args, test_utils=("test_faketensor",))


@needs_mlx
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("two", [False, True])
def test_the_mlx_primitive_equals_the_separate_nodes(tokens, two):
    import mlx.core as mx

    from mlx_flash.kernels import mlx_kernels

    gu, dn, up, _ = layer(two, mlx_kernels.framework_buffer)
    nodes = [None if m is None else mlx_kernels.GraphChannelMajor(m, 2) for m in (gu, up, dn)]
    n_gu, n_up, n_dn = nodes
    x = mx.array(np.random.default_rng(tokens).standard_normal((1, tokens, D)).astype(np.float32))

    def counts():
        return [None if n is None else (n.counters, n.dense_counters) for n in nodes]

    for t_gu, t_down in THRESHOLDS:
        before = counts()
        if two:
            g, u = n_gu(x, t_gu), n_up(x, t_gu)
        else:
            both = n_gu(x, t_gu)
            g, u = both[..., :F], both[..., F:]
        want = n_dn(mlx_kernels.silu_mul(g, u), t_down)
        mx.eval(want)
        mid = counts()
        got = mlx_kernels.cm_gated_ffn(x, n_gu, n_dn, t_gu, t_down, up=n_up)
        mx.eval(got)
        after = counts()
        assert got.shape == (1, tokens, D) and np.array_equal(np.array(got), np.array(want)), (t_gu, t_down)
        for b, m, a in zip(before, mid, after):
            assert b is None or all(np.array_equal(m[i] - b[i], a[i] - m[i]) for i in (0, 1))
    g = mlx_kernels.cm_gated_ffn(x, n_gu, n_dn, 0.5, 0.02, up=n_up, act="gelu_tanh")
    want = separate(np.array(x)[0], gu, dn, up, 0.5, 0.02, "gelu_tanh")
    assert np.array_equal(np.array(g).reshape(tokens, D), want)
    ext = mlx_kernels.extension()
    ext.record_inputs(True)
    try:
        mx.eval(mlx_kernels.cm_gated_ffn(x, n_gu, n_dn, 0.0, 0.0, up=n_up))
        where = [m.buffer.ctypes.data for m in (gu, up, dn) if m is not None]
        assert ext.recorded_inputs() == [("ChannelMajorFFN", w) for w in where]  # read where they lie
    finally:
        ext.record_inputs(False)
    spec_up = () if up is None else n_up.spec
    args = (x, n_gu.buffer, n_gu.spec, n_gu.buffer, spec_up, n_dn.buffer, n_dn.spec, 0.5, 0.02, 0, 1)
    with pytest.raises(ValueError, match="down takes"):
        ext.cm_gated_ffn(*args[:5], n_gu.buffer, n_gu.spec, *args[7:])
    with pytest.raises(ValueError, match="x must be"):
        ext.cm_gated_ffn(mx.ones((1, D + 1)), *args[1:])
    with pytest.raises(ValueError, match="act is 0"):
        ext.cm_gated_ffn(*args[:9], 7, 1)
    with pytest.raises(ValueError, match="past its buffer"):
        ext.cm_gated_ffn(*args[:6], [10**9, *n_dn.spec[1:]], *args[7:])
    with pytest.raises(ValueError, match="6 ints"):
        ext.cm_gated_ffn(*args[:6], n_dn.spec[1:], *args[7:])
