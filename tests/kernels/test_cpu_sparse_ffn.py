"""The CPU member of the sparse FFN kernels (kernels/sparse_ffn.py) against the plain-ops reference
(kernels/sparse_ffn_ref.py), on every code path this CPU can run: both down layouts, bits, group
sizes, scale types, token counts, thread counts and active counts 0, 1, some and all; its refusals;
and on the default model's own store, where the slab spec is read from the manifest."""

import numpy as np
import pytest

from mlx_flash.kernels.qmatmul import cpu_isa, float_paths, use_isa
from mlx_flash.kernels.slab_spec import DownLayout, ScaleType, spec_of
from mlx_flash.kernels.sparse_ffn import CpuSparseFFN
from mlx_flash.kernels.sparse_ffn_ref import random_slab, sparse_down_ref, sparse_gate_up_ref

RUNNABLE = float_paths()  # the float arithmetic's loops
SLOTS = 24


@pytest.fixture
def isa_restored():
    before = cpu_isa()
    yield
    use_isa(before)


def rel_error(got, ref):
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-12)) if ref.size else 0.0


CASES = [  # (block, bits, gate/up group, down bits, down group, scale type)
    (32, 4, 32, 4, None, ScaleType.F16),
    (32, 8, 64, 8, None, ScaleType.F16),
    (32, 4, 128, 8, None, ScaleType.BF16),
    (32, 8, 32, 4, None, ScaleType.F32),
    (64, 4, 32, 4, None, ScaleType.F16),
    (1, 4, 32, 8, 32, ScaleType.F16),
    (1, 8, 64, 4, 64, ScaleType.F32),
    (1, 4, 128, 4, 32, ScaleType.BF16),
]


@pytest.mark.parametrize("block,bits,group,down_bits,down_group,scale_type", CASES)
@pytest.mark.parametrize("tokens", [1, 3, 5])
def test_cpu_kernel_equals_reference(block, bits, group, down_bits, down_group, scale_type, tokens, isa_restored):
    rng = np.random.default_rng(block * 100 + bits * 10 + group + tokens)
    D = 256 if block > 1 else 384
    slab, spec = random_slab(rng, SLOTS, D, block, bits, group, scale_type, down_bits, down_group, pad=12)
    assert spec.down_layout is (DownLayout.BLOCK if block > 1 else DownLayout.COLUMN)
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    worst, worst_abs = {}, [0.0, 0.0]
    for count in (0, 1, 7, SLOTS):
        idx = rng.permutation(SLOTS).astype(np.int32)  # slots in any order; entries past count are junk
        h_ref = sparse_gate_up_ref(x, slab, idx, count, spec)
        y_ref = sparse_down_ref(h_ref, slab, idx, count, spec)
        for isa in RUNNABLE:
            use_isa(isa)
            for threads in (1, 2):
                k = CpuSparseFFN(spec, threads)
                h = k.gate_up(x, slab, idx, count)
                y = k.down(h_ref.astype(np.float32), slab, idx, count)
                assert h.shape == (tokens, count * block) and y.shape == (tokens, D)
                eh, ey = rel_error(h, h_ref), rel_error(y, y_ref)
                worst[isa.name] = max(worst.get(isa.name, 0.0), eh, ey)
                if count:
                    worst_abs[0] = max(worst_abs[0], float(np.abs(h - h_ref).max()))
                    worst_abs[1] = max(worst_abs[1], float(np.abs(y - y_ref).max()))
                assert eh < 2e-5 and ey < 2e-5, f"{isa.name} count={count} threads={threads}: {eh:.1e} {ey:.1e}"
                if count == 0:
                    assert not y.any()
    print(
        f"block {block} gate/up {bits}-bit g{group} down {down_bits}-bit {scale_type.name} T={tokens}: max abs error "
        f"gate_up {worst_abs[0]:.1e}, down {worst_abs[1]:.1e}; max relative (to max |ref|) by path {worst}"
    )


def test_all_slots_in_order_equal_the_dense_layer():
    """count = all slots, idx = 0..S-1: the sparse product is the layer's dense FFN."""
    rng = np.random.default_rng(7)
    slab, spec = random_slab(rng, SLOTS, 256, 32)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    k = CpuSparseFFN(spec)
    idx = np.arange(SLOTS, dtype=np.int32)
    y = k.down(k.gate_up(x, slab, idx, SLOTS), slab, idx, SLOTS)
    dense = sparse_down_ref(sparse_gate_up_ref(x, slab, idx, SLOTS, spec), slab, idx, SLOTS, spec)
    assert rel_error(y, dense) < 2e-5


def test_refusals_name_the_problem():
    rng = np.random.default_rng(3)
    slab, spec = random_slab(rng, 8, 256, 32)
    k = CpuSparseFFN(spec)
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 8\)"):
        k.gate_up(x, slab, np.array([1, 8], np.int32), 2)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 8\)"):
        k.down(np.zeros((1, 64), np.float32), slab, np.array([-1, 2], np.int32), 2)
    with pytest.raises(ValueError, match="slab must be"):
        k.gate_up(x, slab[:, :-4], np.array([0], np.int32), 1)
    with pytest.raises(ValueError, match=r"x must be \[T, 256\]"):
        k.gate_up(np.zeros((1, 128), np.float32), slab, np.array([0], np.int32), 1)


@pytest.mark.slow
def test_default_store_spec_and_layer(store_dir):
    """The default model's store: its manifest gives a block spec, and the kernel over a whole layer
    read from flash equals the reference."""
    from mlx_flash.store.store import open_store

    store = open_store(store_dir)
    layout = store.manifest.ffn
    spec = spec_of(layout)
    assert spec is not None and spec.down_layout is DownLayout.BLOCK and spec.block == layout.block
    with open(store.file_path(layout.file), "rb") as fh:
        fh.seek(layout.layer_offsets[3])
        slab = np.frombuffer(fh.read(layout.layer_nbytes), np.uint8).reshape(layout.n_rows, -1).copy()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, layout.d_model)).astype(np.float32)
    idx = rng.permutation(layout.n_rows).astype(np.int32)
    count = layout.n_rows // 2
    k = CpuSparseFFN(spec, 2)
    h_ref = sparse_gate_up_ref(x, slab, idx, count, spec)
    assert rel_error(k.gate_up(x, slab, idx, count), h_ref) < 2e-5
    assert (
        rel_error(k.down(h_ref.astype(np.float32), slab, idx, count), sparse_down_ref(h_ref, slab, idx, count, spec))
        < 2e-5
    )
