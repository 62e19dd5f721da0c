"""The Metal member of the sparse FFN kernels (kernels/metal_sparse.py) against the plain-ops
reference (kernels/sparse_ffn_ref.py). Every Metal body runs here on the CPU through the MSL shim
(kernels/metal_cpu.py, kernels/metal/msl_shim.h), with the launch arguments MetalSparseFFN uses:
both down layouts, 4/8 bits, gate/up groups 32/64/128, every scale type, 1 and 3 tokens, counts 0,
1, some and all, slot ids in shuffled order with junk past count. On a Metal GPU the same vectors
run through MetalSparseFFN itself. Plus the shim's own synchronization: barriers, SIMD ops, and the
errors it reports instead of wrong numbers or a crash."""

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mlx_flash.errors import KernelUnavailableError
from mlx_flash.kernels import metal_cpu
from mlx_flash.kernels import metal_sparse
from mlx_flash.kernels.metal_sparse import HEADER, KERNELS, MAX_TOKENS, MetalSparseFFN, down_launch, gate_up_launch
from mlx_flash.kernels.slab_spec import DownLayout, ScaleType
from mlx_flash.kernels.sparse_ffn_ref import random_slab, sparse_down_ref, sparse_gate_up_ref
from metal_gpu import metal_available, needs_metal, require_shim  # noqa: E402

TOLERANCE = 1e-4  # of max |reference|

CASES = [  # (block, bits, gate/up group, down bits, down group, scale type, D, slots)
    (32, 4, 32, 4, None, ScaleType.F16, 256, 5),
    (32, 8, 64, 8, None, ScaleType.F16, 576, 4),
    (32, 4, 128, 8, None, ScaleType.BF16, 256, 6),
    (32, 8, 32, 4, None, ScaleType.F32, 576, 3),
    (32, 4, 64, 4, None, ScaleType.F16, 576, 5),
    (1, 4, 32, 8, 32, ScaleType.F16, 576, 40),
    (1, 8, 64, 4, 32, ScaleType.F32, 256, 37),
    (1, 4, 128, 4, 32, ScaleType.BF16, 256, 40),
    (1, 8, 32, 8, 32, ScaleType.F16, 576, 33),
]
TOKENS = (1, 3)


def case_id(case):
    block, bits, group, dbits, _, st, D, S = case
    return f"block{block}-q{bits}g{group}-down{dbits}-{st.name.lower()}-D{D}-S{S}"


def vectors(case, tokens):
    """(spec, slab, x, [(count, idx, h_in, h_ref, y_ref)]) for counts 0, 1, some, all: idx a shuffled
    permutation whose entries past count are out-of-range junk, h_in as gate_up leaves it
    ([T, S*block]) but NaN past count*block: neither may be read."""
    block, bits, group, dbits, dgroup, st, D, S = case
    rng = np.random.default_rng([block, bits, group, dbits, int(st), D, S, tokens])
    slab, spec = random_slab(rng, S, D, block, bits, group, st, dbits, dgroup, pad=8)
    assert spec.down_layout is (DownLayout.BLOCK if block > 1 else DownLayout.COLUMN)
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    runs = []
    for count in (0, 1, (S + 1) // 2, S):
        idx = rng.permutation(S).astype(np.int32)
        idx[count:] = 1 << 20  # a read of idx past count would read far outside the slab: a fault
        h_ref = sparse_gate_up_ref(x, slab, idx, count, spec)
        h_in = np.full((tokens, S * block), np.nan, np.float32)
        h_in[:, : count * block] = h_ref
        runs.append((count, idx, h_in, h_ref, sparse_down_ref(h_ref, slab, idx, count, spec)))
    return spec, slab, x, runs


def error(got, ref) -> tuple[float, float]:
    """(max abs error, max |ref|)."""
    return (float(np.abs(got - ref).max()) if ref.size else 0.0), (float(np.abs(ref).max()) if ref.size else 0.0)


def check(what, got, ref, worst):
    err, scale = error(got, ref)
    worst[what] = max(worst.get(what, 0.0), err)
    assert err <= TOLERANCE * max(scale, 1e-6), f"{what}: max abs error {err:.3e} (max |ref| {scale:.3e})"


# ---- the bodies on the CPU ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shim():
    """The two kernels as metal_cpu objects, every variant the tests launch compiled up front on all cores."""
    require_shim()
    ks = {n: metal_cpu.metal_kernel(n, *KERNELS[n], f"{n}.metal", HEADER) for n in KERNELS}
    jobs, c = [], np.zeros(1, np.int32)
    for case in CASES:
        for T in TOKENS:
            spec, slab, x, runs = vectors(case, T)
            _, idx, h_in, _, _ = runs[-1]
            S = slab.shape[0]
            jobs.append((ks["sparse_gate_up"], [x, slab, idx, c], gate_up_launch(spec, T, S)["template"]))
            jobs.append((ks["sparse_down"], [h_in, slab, idx, c], down_launch(spec, T, S)["template"]))
    for case in GEOMETRY_CASES:
        spec, slab, x, runs = vectors(case, MAX_TOKENS)
        _, idx, h_in, _, _ = runs[-1]
        S = slab.shape[0]
        jobs.append((ks["sparse_gate_up"], [x, slab, idx, c], gate_up_launch(spec, MAX_TOKENS, S)["template"]))
        for sg in GEOMETRY_SIMDGROUPS:
            jobs.append((ks["sparse_down"], [h_in, slab, idx, c], down_launch(spec, MAX_TOKENS, S, sg)["template"]))
    with ThreadPoolExecutor() as pool:
        list(pool.map(lambda j: j[0].build(j[1], [np.float32], j[2]), jobs))
    return ks


def run_shim(ks, spec, slab, x, count, idx, h_in, **geometry):
    T, S, c = x.shape[0], slab.shape[0], np.array([count], np.int32)
    gu = {k: v for k, v in geometry.items() if k == "max_rows"}
    dn = {k: v for k, v in geometry.items() if k == "simdgroups"}
    f32 = [np.float32]
    (h,) = ks["sparse_gate_up"](inputs=[x, slab, idx, c], output_dtypes=f32, **gate_up_launch(spec, T, S, **gu))
    (y,) = ks["sparse_down"](inputs=[h_in, slab, idx, c], output_dtypes=f32, **down_launch(spec, T, S, **dn))
    return h, y


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_metal_bodies_equal_reference_on_cpu(shim, case, tokens):
    spec, slab, x, runs = vectors(case, tokens)
    worst = {}
    for count, idx, h_in, h_ref, y_ref in runs:
        h, y = run_shim(shim, spec, slab, x, count, idx, h_in)
        B = spec.block
        assert h.shape == (tokens, slab.shape[0] * B) and y.shape == (tokens, spec.d_model)
        check(f"gate_up count={count}", h[:, : count * B], h_ref, worst)
        assert not h[:, count * B :].any(), f"count={count}: h past count*block is not 0"
        check(f"down count={count}", y, y_ref, worst)
        if count == 0:
            assert not y.any()
    print(case_id(case), f"T={tokens}", {k: f"{v:.1e}" for k, v in worst.items()})


GEOMETRY_CASES = [CASES[0], CASES[6]]
GEOMETRY_SIMDGROUPS = (1, 3)


@pytest.mark.parametrize("case", GEOMETRY_CASES, ids=case_id)
def test_max_tokens_and_other_geometries_on_cpu(shim, case):
    """MAX_TOKENS tokens; fewer SIMD groups than rows (gate_up loops over rows); 1 SIMD group (no
    reduction) or 3 (threadgroups of 96 threads) splitting the bundles in down."""
    spec, slab, x, runs = vectors(case, MAX_TOKENS)
    worst = {}
    for max_rows, simdgroups in zip((8, 12), GEOMETRY_SIMDGROUPS):
        for count, idx, h_in, h_ref, y_ref in runs:
            h, y = run_shim(shim, spec, slab, x, count, idx, h_in, max_rows=max_rows, simdgroups=simdgroups)
            check(f"gate_up rows={max_rows} count={count}", h[:, : count * spec.block], h_ref, worst)
            assert not h[:, count * spec.block :].any()
            check(f"down simdgroups={simdgroups} count={count}", y, y_ref, worst)
    print(case_id(case), f"T={MAX_TOKENS}", {k: f"{v:.1e}" for k, v in worst.items()})


# ---- the same vectors through MetalSparseFFN on a Metal GPU ----------------------------------------------
needs_metal = needs_metal("the bodies")


@needs_metal
@pytest.mark.parametrize("tokens", (*TOKENS, MAX_TOKENS + 2))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_metal_kernels_equal_reference(case, tokens):
    import mlx.core as mx

    spec, slab, x, runs = vectors(case, tokens)
    k = MetalSparseFFN(spec)
    assert k.name == "metal"
    worst = {}
    for count, idx, h_in, h_ref, y_ref in runs:
        args = mx.array(slab), mx.array(idx), mx.array([count], mx.int32)
        h = np.array(k.gate_up(mx.array(x), *args))
        y = np.array(k.down(mx.array(h_in), *args))
        check(f"gate_up count={count}", h[:, : count * spec.block], h_ref, worst)
        assert not h[:, count * spec.block :].any()
        check(f"down count={count}", y, y_ref, worst)
    print(case_id(case), f"T={tokens}", {k: f"{v:.1e}" for k, v in worst.items()})


@pytest.mark.skipif(metal_available(), reason="Metal is available here")
def test_metal_member_refuses_without_metal():
    _, spec = random_slab(np.random.default_rng(0), 2, 256, 32)
    with pytest.raises(KernelUnavailableError, match="Metal"):
        MetalSparseFFN(spec)


# ---- the shim itself ---------------------------------------------------------------------------------------
SYNC_BODY = """
threadgroup float buf[48];
const uint i = thread_index_in_threadgroup;
const uint n = threads_per_threadgroup.x;
const uint g = threadgroup_position_in_grid.x;
buf[i] = float(100 * g + i);
BARRIER
neighbour[g * 48 + i] = buf[(i + 1) % n];
lane_sum[g * 48 + i] = metal::simd_sum(float(thread_index_in_simdgroup));
down1[g * 48 + i] = metal::simd_shuffle_down(int(thread_index_in_simdgroup), ushort(1));
"""


def run_sync(body, seed=0):
    outs = {n: ((96,), np.float32 if n != "down1" else np.int32, None) for n in ("neighbour", "lane_sum", "down1")}
    return metal_cpu.run_metal_body(
        body, {"unused": np.zeros(1, np.float32)}, outs, grid=(96, 1, 1), threadgroup=(48, 1, 1), seed=seed
    )


def test_shim_barrier_and_simd_ops_synchronize(shim):
    """Threadgroups of 48 threads: a SIMD group of 32 lanes and one of 16. Each thread writes threadgroup
    memory, waits at the barrier and reads its neighbour's value (only its own threadgroup's); simd_sum
    of the lane ids is 496 (0..31) and 120 (0..15); simd_shuffle_down(1) is the next lane's id, the
    last lane of each SIMD group keeping its own."""
    i = np.arange(48)
    for seed in (0, 1):
        r = run_sync(SYNC_BODY.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);"), seed)
        for g in (0, 1):
            np.testing.assert_array_equal(r["neighbour"][g * 48 : (g + 1) * 48], 100 * g + (i + 1) % 48)
        np.testing.assert_array_equal(r["lane_sum"].reshape(2, 48), np.tile(np.r_[[496] * 32, [120] * 16], (2, 1)))
        next_lane = np.r_[np.arange(1, 32), 31, np.arange(1, 16), 15]  # the last lane of each keeps its own
        np.testing.assert_array_equal(r["down1"].reshape(2, 48), np.tile(next_lane, (2, 1)))


def test_shim_exposes_a_missing_barrier(shim):
    """Without the barrier, threads read neighbours that have not written yet (poisoned threadgroup memory)."""
    r = run_sync(SYNC_BODY.replace("BARRIER", ""))
    expected = np.r_[100 * 0 + (np.arange(48) + 1) % 48, 100 + (np.arange(48) + 1) % 48]
    assert not np.array_equal(r["neighbour"], expected)


def test_shim_reports_broken_rules(shim):
    x = np.zeros(64, np.float32)
    out = {"y": ((64,), np.float32, 0.0)}
    early_exit = """
    if (thread_position_in_grid.x >= 40) { return; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[thread_position_in_grid.x] = x[thread_position_in_grid.x];"""
    with pytest.raises(metal_cpu.MetalShimError, match="returned before it"):
        metal_cpu.run_metal_body(early_exit, {"x": x}, out, grid=(64, 1, 1), threadgroup=(64, 1, 1))
    past_end = "y[thread_position_in_grid.x] = x[thread_position_in_grid.x + 1];"
    with pytest.raises(metal_cpu.MetalShimError, match="past the end of 'x'"):
        metal_cpu.run_metal_body(past_end, {"x": x}, out, grid=(64, 1, 1), threadgroup=(32, 1, 1))
    into_input = "((device float*)x)[thread_position_in_grid.x] = 1.0f;"
    with pytest.raises(metal_cpu.MetalShimError, match="store into input 'x'"):
        metal_cpu.run_metal_body(into_input, {"x": x}, out, grid=(64, 1, 1), threadgroup=(32, 1, 1))
    divergent = """
    float v = 1.0f;
    if (thread_index_in_simdgroup < 8) {
      v = metal::simd_sum(v);
    } else {
      v = metal::simd_sum(v) * 2.0f;
    }
    y[thread_position_in_grid.x] = v;"""
    with pytest.raises(metal_cpu.MetalShimError, match="different simd ops"):
        metal_cpu.run_metal_body(divergent, {"x": x}, out, grid=(64, 1, 1), threadgroup=(32, 1, 1))
    # lanes that returned are inactive, as on hardware: the sum over the 8 that remain
    subset = """
    if (thread_index_in_simdgroup >= 8) { return; }
    y[thread_position_in_grid.x] = metal::simd_sum(1.0f);"""
    r = metal_cpu.run_metal_body(subset, {"x": x}, out, grid=(64, 1, 1), threadgroup=(32, 1, 1))["y"]
    np.testing.assert_array_equal(r.reshape(2, 32), np.tile(np.r_[[8.0] * 8, [0.0] * 24], (2, 1)))


@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=case_id)
def test_shim_signature_is_mlx_signature(shim, case, tmp_path, capfd):
    """The parameters the shim declares for each body are the ones MLX generates (which MLX prints
    when tracing the kernel for export, possible without a Metal GPU in recent versions)."""
    mx = pytest.importorskip("mlx.core")
    spec, slab, x, runs = vectors(case, 3)
    _, idx, h_in, _, _ = runs[1]  # count 1: idx of any length, count of 1 element (constant space)
    S, c = slab.shape[0], np.array([1], np.int32)
    for name, launch, a in (("sparse_gate_up", gate_up_launch, x), ("sparse_down", down_launch, h_in)):
        k = metal_sparse._metal_kernel(name)

        def traced(*arrays, k=k, launch=launch):
            return k(inputs=list(arrays), output_dtypes=[mx.float32], verbose=True, **launch(spec, 3, S))[0]

        capfd.readouterr()
        try:
            mx.export_function(str(tmp_path / f"{name}.mlxfn"), traced, *(mx.array(v) for v in (a, slab, idx, c)))
        except Exception as e:  # older MLX: no tracing without Metal
            pytest.skip(f"this MLX does not trace Metal kernels here: {e}")
        generated = re.search(r"\[\[kernel\]\] void \w+\(\n(.*?)\) \{", capfd.readouterr().out, re.S)
        assert generated, "MLX printed no kernel source"
        mlx_params = [re.sub(r"\s*\[\[.*?\]\]", "", p).strip() for p in generated[1].split(",\n")]
        shim_params, _ = shim[name].signature([a, slab, idx, c], [np.float32])
        assert shim_params == mlx_params
