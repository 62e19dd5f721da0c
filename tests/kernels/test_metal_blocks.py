"""The Metal product over GGUF block rows (kernels/metal_blocks.py, metal/block_matmul.metal) against
the plain-ops reference (kernels/gguf_blocks_ref.py). The body runs here on the CPU through the MSL
shim (kernels/metal_cpu.py) with the launch arguments MetalBlockMatmul uses: every kind, row counts
that do not fill a threadgroup, rows with fewer and more runs of 32 weights than a SIMD group has
lanes, 1 and 3 float16 tokens into float16 (the GPU backend's activations) and more tokens than one
pass holds in float32. Deliberately broken bodies must fail the comparison. The MLX backend's GPU
branches are run with the body in the shim; on a Metal GPU the vectors run through MetalBlockMatmul."""

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mlx_flash.errors import KernelUnavailableError
from mlx_flash.kernels import metal_blocks, metal_cpu
from mlx_flash.kernels.blockmatmul import BlockMatrix
from mlx_flash.kernels.gguf_blocks_ref import BLOCKS, block_matmul_ref, dequantize
from mlx_flash.kernels.metal_blocks import (
    HEADER,
    INPUTS,
    KERNEL,
    MAX_TOKENS,
    OUTPUTS,
    MetalBlockMatmul,
    check_operands,
    check_rows,
    launch,
    plain_rows,
)
from mlx_flash.quant_spec import QuantSpec

from kernel_vectors import random_bytes
from metal_gpu import metal_available, needs_metal, require_shim  # noqa: E402

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
SHAPES = {  # kind -> [(K, N)]: N never a multiple of the 4 rows of a threadgroup; runs below and above 32
    "Q5_0": [(96, 7), (1088, 13)],
    "Q5_1": [(1088, 7), (64, 5)],
    "Q4_K": [(256, 7), (1280, 13)],
    "Q5_K": [(512, 13), (1280, 5)],
    "Q6_K": [(256, 13), (1280, 7)],
}
VARIANTS = [(F16, F16, 1), (F16, F16, 3), (F32, F32, MAX_TOKENS + 3)]  # (x dtype, output dtype, tokens)
CASES = [(kind, K, N) for kind, shapes in SHAPES.items() for K, N in shapes]


def case_id(case):
    kind, K, N = case
    return f"{kind}-K{K}-N{N}"


def vectors(kind, K, N, x_dtype, tokens):
    rng = np.random.default_rng([BLOCKS[kind].ggml_type, K, N, tokens])
    raw = random_bytes(kind, N, K, seed=K + N)
    return raw, rng.standard_normal((tokens, K)).astype(x_dtype)


def within(y, x, raw, kind) -> np.ndarray:
    """Where y is the reference product up to float32 accumulation order (1e-5 of sum |x| |w|, which
    grows with K), plus the rounding of a float16 output."""
    ref = block_matmul_ref(x.astype(np.float32), raw, kind)
    mag = np.abs(x.astype(np.float64)) @ np.abs(dequantize(raw, kind).astype(np.float64)).T
    tol = 1e-5 * mag + (np.abs(ref) * 2.0**-11 + 2.0**-24 if y.dtype == F16 else 0.0)
    return np.abs(y.astype(np.float64) - ref) <= tol


def check(what, y, x, raw, kind):
    ok = within(y, x, raw, kind)
    ref = block_matmul_ref(x.astype(np.float32), raw, kind)
    assert ok.all(), (
        f"{what}: {int((~ok).sum())} of {ok.size} outputs off, max abs error "
        f"{np.abs(y.astype(np.float64) - ref).max():.3e} (max |ref| {np.abs(ref).max():.3e})"
    )


def run(k, kind, raw, x, out_dtype, **geometry):
    args = launch(kind, x.shape[0], raw.shape[0], out_dtype, **geometry)
    return k(inputs=[x, raw], output_dtypes=[out_dtype], **args)[0]


# ---- the body on the CPU ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shim():
    """The kernel as a metal_cpu object, every variant the tests launch compiled up front on all cores."""
    require_shim()
    k = metal_cpu.metal_kernel(KERNEL, INPUTS, OUTPUTS, f"{KERNEL}.metal", HEADER)
    jobs = []
    for kind, shapes in SHAPES.items():
        K, N = shapes[0]
        for x_dtype, out_dtype, T in VARIANTS + [(F16, F32, 3)]:
            raw, x = vectors(kind, K, N, x_dtype, T)
            jobs.append(([x, raw], [out_dtype], launch(kind, T, N, out_dtype)["template"]))
    with ThreadPoolExecutor() as pool:
        list(pool.map(lambda j: k.build(*j), jobs))
    return k


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"x{v[0]}-y{v[1]}-T{v[2]}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_metal_body_equals_reference_on_cpu(shim, case, variant):
    kind, K, N = case
    x_dtype, out_dtype, T = variant
    raw, x = vectors(kind, K, N, x_dtype, T)
    y = run(shim, kind, raw, x, out_dtype)
    assert y.shape == (T, N) and y.dtype == out_dtype
    check(f"{case_id(case)} T={T}", y, x, raw, kind)


@pytest.mark.parametrize("kind", list(SHAPES))
def test_float16_output_is_the_float32_sum_rounded(shim, kind):
    """The same sums (one accumulation order), stored as float16 or float32: the float16 output is the
    float32 one rounded to nearest even."""
    K, N = SHAPES[kind][0]
    raw, x = vectors(kind, K, N, F16, 3)
    y16, y32 = run(shim, kind, raw, x, F16), run(shim, kind, raw, x, F32)
    assert np.array_equal(y16.view(np.uint16), y32.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("kind", ["Q5_1", "Q6_K"])
def test_fewer_simd_groups_than_rows_on_cpu(shim, kind):
    """Grids of 1 and 3 SIMD groups: each loops over rows y, y + ROWS, ..."""
    K, N = SHAPES[kind][1]
    for x_dtype, out_dtype, T in VARIANTS:
        raw, x = vectors(kind, K, N, x_dtype, T)
        for max_rows in (1, 3):
            check(
                f"{kind} T={T} max_rows={max_rows}", run(shim, kind, raw, x, out_dtype, max_rows=max_rows), x, raw, kind
            )


MUTATIONS = [  # (kind, file, text, broken text): each an error the comparison must catch
    ("Q4_K", HEADER, "row + (u / mf_block_runs<KIND>())", "row + ((u / mf_block_runs<KIND>() + 1) % 5)"),
    ("Q5_0", f"{KERNEL}.metal", "mf_decode_run<KIND>(row, u, wv)", "mf_decode_run<KIND>(row, (u + 1) % runs, wv)"),
    ("Q5_1", HEADER, "w[j] = d * float(lo) + m;", "w[j] = d * float(lo) - m;"),
    ("Q5_K", HEADER, "(uint(qh[l]) >> s) & 1u", "(uint(qh[l]) >> (s ^ 1)) & 1u"),
    ("Q6_K", HEADER, "(l < 16 ? d0 : d1)", "(l < 15 ? d0 : d1)"),
    ("Q4_K", f"{KERNEL}.metal", "ulong(t0 + t) * K + u * 32", "ulong(t0) * K + u * 32"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[f"{m[0]}-{m[1]}-{i}" for i, m in enumerate(MUTATIONS)])
def test_a_broken_body_fails_the_comparison(shim, mutation):
    """The comparison is sharp enough to catch a wrong block (off by one), a wrong run, a sign, a
    fifth bit from the wrong sub-block, a scale boundary and a token stride (Q4_K K=1280: 5 blocks)."""
    kind, name, text, broken = mutation
    files = {f: metal_cpu.metal_text(f) for f in (f"{KERNEL}.metal", HEADER)}
    if files[name].count(text) != 1:
        raise AssertionError(f"{name} no longer holds {text!r} once; update the mutation")
    files[name] = files[name].replace(text, broken)
    k = metal_cpu.metal_kernel(KERNEL, INPUTS, OUTPUTS, files[f"{KERNEL}.metal"], files[HEADER])
    K, N = SHAPES[kind][1] if kind in ("Q4_K", "Q5_0") else SHAPES[kind][0]
    raw, x = vectors(kind, K, N, F32, 3)
    assert within(run(shim, kind, raw, x, F32), x, raw, kind).all()  # the intact body passes on these vectors
    assert not within(run(k, kind, raw, x, F32), x, raw, kind).all(), f"{broken!r} went unnoticed"


def test_shim_rounds_float_to_half_as_numpy():
    """The shim's float -> float16 (float16 outputs): nearest even, subnormals, overflow, signs, NaN."""
    rng = np.random.default_rng(1)
    special = np.array(
        [
            0.0,
            -0.0,
            1.0,
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            1e9,
            np.inf,
            -np.inf,
            2.0**-24,
            2.0**-25,
            3 * 2.0**-26,
            2.0**-14,
            2.0**-14 - 2.0**-26,
            1 + 2.0**-11,
            1 + 3 * 2.0**-11,
            2.0**-30,
        ],
        np.float32,
    )
    bits = rng.integers(0, 1 << 32, 3000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ties = (rng.integers(-(1 << 12), 1 << 12, 500).astype(np.float32) + 0.5) * np.float32(2.0**-10)
    x = np.concatenate([special, -special, bits, ties, rng.standard_normal(500).astype(np.float32)])
    x = x[~np.isnan(x)]
    x = np.concatenate([x, np.array([np.nan], np.float32)])
    body = "const uint i = thread_position_in_grid.x; y[i] = static_cast<float16_t>(x[i]);"
    y = metal_cpu.run_metal_body(
        body, {"x": x}, {"y": (x.shape, F16, None)}, grid=(x.size, 1, 1), threadgroup=(256, 1, 1)
    )["y"]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    finite = ~np.isnan(want)
    assert np.array_equal(y[finite].view(np.uint16), want[finite].view(np.uint16))
    assert np.isnan(y[~finite]).all()


# ---- launch arguments and the rows the kernel reads ---------------------------------------------------------
def test_launch_and_operands_are_checked():
    assert check_rows("Q6_K", (5, 420)) == (512, 5)
    assert check_operands("Q5_0", (3, 64), (7, 44)) == (3, 64, 7)
    with pytest.raises(ValueError, match="whole 210-byte blocks"):
        check_rows("Q6_K", (5, 400))
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        check_operands("Q5_0", (3, 32), (7, 44))
    with pytest.raises(ValueError, match="not one of"):
        check_rows("Q2_K", (1, 84))
    with pytest.raises(ValueError, match="tokens and rows"):
        launch("Q4_K", 0, 4, F32)
    a = launch("Q4_K", 20, 100000, F16)
    assert dict(a["template"]) == {"KIND": 12, "TT": MAX_TOKENS, "OT": F16}
    assert a["grid"] == (32, metal_blocks.MAX_ROWS, 1) and a["output_shapes"] == [(20, 100000)]


def laid_out(kind, nb, per, n_gate, D):
    """Gate-like rows (blocks of `per` rows, one block per bundle; n_gate of them, the last block short)
    and a down-like matrix (D rows whose blocks are the bundles) written into a buffer of nb bundles
    with junk between fields: (buffer, gate rows, down rows, their BlockMatrix views)."""
    blk = BLOCKS[kind]
    rng = np.random.default_rng(2)
    gate, down = random_bytes(kind, n_gate, 512, seed=3), random_bytes(kind, D, nb * blk.weights, seed=4)
    width = gate.shape[1] + 12  # the field's row stride: wider than a row
    gate_at, down_at = 16, 16 + per * width
    bb = down_at + D * blk.nbytes + 8
    buf = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
    for n in range(n_gate):
        buf[n // per, gate_at + n % per * width :][: gate.shape[1]] = gate[n]
    for d in range(D):
        for b in range(nb):
            buf[b, down_at + d * blk.nbytes :][: blk.nbytes] = down[d, b * blk.nbytes : (b + 1) * blk.nbytes]
    g = BlockMatrix.in_buffer(buf, gate_at, kind, n_gate, 512, per, bb, width, blk.nbytes)
    dn = BlockMatrix.in_buffer(buf, down_at, kind, D, nb * blk.weights, D, 0, blk.nbytes, bb)
    return buf, gate, down, g, dn


def test_plain_rows_copies_strided_rows_and_refuses_bundles():
    _, _, _, g, dn = laid_out("Q6_K", 3, 4, 10, 6)
    for m in (g, dn):
        with pytest.raises(ValueError, match="in place"):
            plain_rows(m)
    wide = random_bytes("Q5_1", 6, 128 + 32)
    strided = BlockMatrix(wide[:, :96], "Q5_1")  # rows with a stride past their bytes
    assert np.array_equal(plain_rows(strided), wide[:, :96]) and plain_rows(strided).flags.c_contiguous
    plain = random_bytes("Q5_1", 6, 128)
    assert plain_rows(BlockMatrix(plain, "Q5_1")) is plain  # already what the kernel reads: no copy


# ---- the MLX backend's GPU branches, the body run by the shim --------------------------------------------
class ShimBlockMatmul(MetalBlockMatmul):
    """MetalBlockMatmul with the body run on the CPU through the shim (mx arrays in and out)."""

    kernel = None

    def __init__(self, raw, kind):
        self.raw, self.kind = raw, kind
        self.k_in, self.n_out = check_rows(kind, raw.shape)

    def __call__(self, x):
        import mlx.core as mx

        xs = np.array(x.reshape(-1, self.k_in))
        y = run(self.kernel, self.kind, np.array(self.raw), xs, xs.dtype)
        return mx.array(y).reshape(*x.shape[:-1], self.n_out)


def test_backend_gpu_branches_multiply_block_weights_with_the_body(shim, monkeypatch):
    """On a GPU the backend copies a block weight's rows once into an mx.array (counted once), the
    Metal product multiplies them in float16, embedding rows come from the same copy, and rows inside
    bundles (kernel_weight) stay in place for the CPU primitive."""
    mx = pytest.importorskip("mlx.core")
    from mlx_flash.backends import mlx as backend, mlx_weights

    ops = backend.MLXOps()
    ops.on_gpu, ops.act_dtype = True, mx.float16  # the GPU branches; the product below is the shim's
    monkeypatch.setattr(ShimBlockMatmul, "kernel", shim)
    monkeypatch.setattr(mlx_weights, "MetalBlockMatmul", ShimBlockMatmul)
    kind, (K, N) = "Q6_K", SHAPES["Q6_K"][0]
    raw, x = vectors(kind, K, N, F16, 3)
    w = ops.weight({"weight": raw}, QuantSpec.block(kind))
    assert isinstance(w.metal, ShimBlockMatmul) and w.metal.raw.dtype == mx.uint8
    assert ops.held_bytes(w) == raw.nbytes  # the one copy, which embedding rows read too
    y = ops.linear(mx.array(x.reshape(1, 3, K)), w)
    assert y.dtype == mx.float16 and y.shape == (1, 3, N)
    check("weight()", np.array(y).reshape(3, N), x, raw, kind)
    rows = np.array(ops.embedding(w, mx.array(np.array([4, 0], np.int32))))
    assert np.array_equal(rows, dequantize(raw[[4, 0]], kind).astype(np.float16))

    kind = "Q4_K"  # rows inside a layer's bundles stay in place (they may stream): the CPU primitive
    _, gate, down, g, dn = laid_out(kind, 5, 4, 18, 7)
    kw = ops.kernel_weight(g, QuantSpec.block(kind))
    assert kw.metal is None and kw.graph is not None and ops.held_bytes(kw) == 0


# ---- the same vectors through MetalBlockMatmul on a Metal GPU ------------------------------------------------
needs_metal = needs_metal("the body")


@needs_metal
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"x{v[0]}-T{v[2]}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_metal_kernel_equals_reference(case, variant):
    import mlx.core as mx

    kind, K, N = case
    x_dtype, _, T = variant
    raw, x = vectors(kind, K, N, x_dtype, T)
    k = MetalBlockMatmul(mx.array(raw), kind)
    assert k.name == "metal"
    y = k(mx.array(x).reshape(1, T, K))
    assert y.dtype == (mx.float16 if x_dtype == F16 else mx.float32) and y.shape == (1, T, N)
    check(f"{case_id(case)} T={T}", np.array(y).reshape(T, N), x, raw, kind)


@pytest.mark.skipif(metal_available(), reason="Metal is available here")
def test_metal_product_refuses_without_metal():
    mx = pytest.importorskip("mlx.core")
    with pytest.raises(KernelUnavailableError, match="Metal"):
        MetalBlockMatmul(mx.array(random_bytes("Q4_K", 2, 256)), "Q4_K")


def test_shim_signature_is_mlx_signature(shim, tmp_path, capfd):
    """The parameters the shim declares for the body are the ones MLX generates (which MLX prints
    when tracing the kernel for export, possible without a Metal GPU in recent versions)."""
    mx = pytest.importorskip("mlx.core")
    kind, (K, N) = "Q5_K", SHAPES["Q5_K"][0]
    raw, x = vectors(kind, K, N, F16, 3)
    k = metal_blocks._metal_kernel()

    def traced(a, b):
        return k(inputs=[a, b], output_dtypes=[mx.float16], verbose=True, **launch(kind, 3, N, mx.float16))[0]

    capfd.readouterr()
    try:
        mx.export_function(str(tmp_path / "block_matmul.mlxfn"), traced, mx.array(x), mx.array(raw))
    except Exception as e:  # older MLX: no tracing without Metal
        pytest.skip(f"this MLX does not trace Metal kernels here: {e}")
    generated = re.search(r"\[\[kernel\]\] void \w+\(\n(.*?)\) \{", capfd.readouterr().out, re.S)
    assert generated, "MLX printed no kernel source"
    mlx_params = [re.sub(r"\s*\[\[.*?\]\]", "", p).strip() for p in generated[1].split(",\n")]
    shim_params, _ = shim.signature([x, raw], [F16])
    assert shim_params == mlx_params
