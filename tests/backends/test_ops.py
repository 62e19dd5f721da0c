"""The torch adapter implements the MLX op semantics: each op is compared with mlx on random inputs.
The torch int4-kernel weight forms are checked against the plain dequantized reference."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.backends import get_backend
from mlx_flash.errors import ConfigError
from mlx_flash.kernels.qmatmul_ref import qmatmul_ref
from mlx_flash.quant_spec import QuantSpec

torch = pytest.importorskip("torch")

rng = np.random.default_rng(0)


@pytest.fixture(scope="module")
def ops():
    return get_backend("mlx"), get_backend("torch")


def both(ops, a):
    m, t = ops
    return m.array(a), t.array(a)


def close(x_mlx, x_torch, ops, tol=1e-5):
    a, b = ops[0].to_numpy(x_mlx), ops[1].to_numpy(x_torch)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("offset", [0, 37])
def test_rope(ops, traditional, offset):
    x = rng.standard_normal((1, 3, 5, 16)).astype(np.float32)
    xm, xt = both(ops, x)
    close(ops[0].rope(xm, 16, traditional, 10000.0, offset), ops[1].rope(xt, 16, traditional, 10000.0, offset), ops)


@pytest.mark.parametrize("T,S", [(1, 9), (4, 4), (3, 10)])
def test_sdpa_gqa_causal(ops, T, S):
    q = rng.standard_normal((1, 6, T, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, S, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, S, 8)).astype(np.float32)
    (qm, qt), (km, kt), (vm, vt) = both(ops, q), both(ops, k), both(ops, v)
    mask = "causal" if T > 1 else None
    close(ops[0].sdpa(qm, km, vm, 0.3, mask), ops[1].sdpa(qt, kt, vt, 0.3, mask), ops)


@pytest.mark.parametrize("traditional", [True, False])
def test_rope_per_row_offsets_equal_each_row_alone(ops, traditional):
    x = rng.standard_normal((3, 2, 4, 16)).astype(np.float32)
    offsets = np.array([0, 7, 130])
    for o in ops:
        got = o.to_numpy(o.rope(o.array(x), 16, traditional, 10000.0, offsets))
        for b, off in enumerate(offsets):
            alone = o.to_numpy(o.rope(o.array(x[b : b + 1]), 16, traditional, 10000.0, int(off)))
            np.testing.assert_allclose(got[b : b + 1], alone, atol=1e-6)
        pos = o.to_numpy(o.positions(offsets, 4))
        np.testing.assert_array_equal(pos, offsets[:, None] + np.arange(4))


def test_sdpa_boolean_mask_equals_unpadded_rows(ops):
    """Right-padded keys hidden by a mask give each row what its own keys give alone."""
    lengths, T = [3, 9], 2
    q = rng.standard_normal((2, 6, T, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 9, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 9, 8)).astype(np.float32)
    keep = np.zeros((2, 1, T, 9), bool)
    for b, n in enumerate(lengths):
        keep[b, 0] = np.arange(9)[None, :] <= np.arange(T)[:, None] + n - T
    for o in ops:
        got = o.to_numpy(o.sdpa(o.array(q), o.array(k), o.array(v), 0.3, o.mask(keep)))
        for b, n in enumerate(lengths):
            alone = o.to_numpy(
                o.sdpa(o.array(q[b : b + 1]), o.array(k[b : b + 1, :, :n]), o.array(v[b : b + 1, :, :n]), 0.3, "causal")
            )
            np.testing.assert_allclose(got[b : b + 1], alone, atol=1e-5)


def test_norms_and_activations(ops):
    x = rng.standard_normal((2, 3, 32)).astype(np.float32)
    w = rng.standard_normal(32).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    (xm, xt), (wm, wt), (bm, bt) = both(ops, x), both(ops, w), both(ops, b)
    close(ops[0].rms_norm(xm, wm, 1e-5), ops[1].rms_norm(xt, wt, 1e-5), ops)
    close(ops[0].layer_norm(xm, wm, bm, 1e-5), ops[1].layer_norm(xt, wt, bt, 1e-5), ops)
    close(ops[0].silu(xm), ops[1].silu(xt), ops)
    close(ops[0].gelu(xm), ops[1].gelu(xt), ops)
    for a, b_ in zip(ops[0].split(xm, [8, 24]), ops[1].split(xt, [8, 24])):
        close(a, b_, ops)


def quantized(n_out, n_in, bits, group=32):
    w = mx.array(rng.standard_normal((n_out, n_in)).astype(np.float16))
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return {"weight": np.array(q), "scales": np.array(s), "biases": np.array(b)}, QuantSpec(bits, group)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("transposed", [False, True])
def test_quantized_linear_exact_mode(ops, bits, transposed):
    parts, spec = quantized(64, 96, bits)
    x = rng.standard_normal((3, 64 if transposed else 96)).astype(np.float32)
    wm, wt = ops[0].weight(parts, spec, transposed), ops[1].weight(parts, spec, transposed)
    xm, xt = both(ops, x)
    close(ops[0].linear(xm, wm), ops[1].linear(xt, wt), ops, tol=1e-4)


def test_embedding_of_quantized_table(ops):
    parts, spec = quantized(50, 64, 8)
    ids = np.array([[3, 0, 49]])
    wm, wt = ops[0].weight(parts, spec), ops[1].weight(parts, spec)
    close(ops[0].embedding(wm, mx.array(ids)), ops[1].embedding(wt, torch.as_tensor(ids)), ops)


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_backends_hold_quantized_weights_as_stored(ops, bits):
    """On a CPU both backends keep the stored codes, scales and biases (no float copy) and compute on
    them; the result equals the float64 product with the dequantized weight to float32 rounding."""
    parts, spec = quantized(64, 96, bits)
    stored = sum(a.nbytes for a in parts.values())
    x = rng.standard_normal((2, 96)).astype(np.float32)
    ref = qmatmul_ref(x, parts["weight"], parts["scales"], parts["biases"], bits, 32)  # float64
    for backend in ops:
        w = backend.weight(parts, spec)
        assert backend.held_bytes(w) == stored, backend.name
        y = backend.to_numpy(backend.linear(backend.array(x), w))
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)


def test_embedding_rows_equal_mlx_dequantize_bit_for_bit(ops):
    parts, spec = quantized(50, 64, 4)
    ids = np.array([[7, 0, 49, 7]])
    f32 = {k: mx.array(parts[k][ids[0]]).astype(mx.float32) for k in ("scales", "biases")}  # as the engine held them
    ref = np.array(
        mx.dequantize(mx.array(parts["weight"][ids[0]]), f32["scales"], f32["biases"], group_size=32, bits=4)
    )
    got_mlx = ops[0].to_numpy(ops[0].embedding(ops[0].weight(parts, spec), mx.array(ids)))[0]
    got_torch = ops[1].to_numpy(ops[1].embedding(ops[1].weight(parts, spec), torch.as_tensor(ids)))[0]
    assert np.array_equal(got_mlx, ref) and np.array_equal(got_torch, ref)


@pytest.mark.parametrize("bits", [4, 8])
def test_int4_kernel_forms_match_reference(bits):
    """The fast mode's int4 packing re-expresses the same weights (8-bit as two 4-bit halves):
    only bfloat16 rounding of inputs/scales/outputs separates it from the float32 reference."""
    exact, fast = get_backend("torch"), get_backend("torch", dtype="bfloat16")
    parts, spec = quantized(128, 256, bits)
    we, wf = exact.weight(parts, spec), fast.weight(parts, spec)
    assert wf.kind == ("int4" if bits == 4 else "int4x2")
    x = torch.randn(2, 256)
    ref, got = exact.linear(x, we), fast.linear(x, wf)
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert rel < 2e-2, rel


def test_unknown_backend_and_dtype():
    with pytest.raises(ConfigError, match="backend 'jax' is unknown"):
        get_backend("jax")
    with pytest.raises(ConfigError, match="torch dtype 'int3' is unknown"):
        get_backend("torch", dtype="int3")


def test_held_bytes_count_views_inside_one_buffer_once(ops):
    """A tensor that views part of a buffer another leaf owns (torch.from_numpy of a slice: its
    storage starts mid-buffer) holds no memory of its own; a separate buffer does."""
    from mlx_flash.backends import covered_bytes

    buf = np.zeros(4096, dtype=np.uint8)
    apart = np.zeros(100, dtype=np.uint8)
    assert covered_bytes([(0, 10), (5, 10), (20, 5), (21, 2)]) == 20
    t = ops[1]
    tree = {
        "whole": buf,
        "slice": torch.from_numpy(buf[1024:2048]),
        "again": torch.from_numpy(buf[1024:1536]),
        "apart": apart,
    }
    assert t.held_bytes(tree) == 4096 + 100
    assert ops[0].held_bytes({"whole": buf, "view": buf[100:200], "apart": apart}) == 4096 + 100
