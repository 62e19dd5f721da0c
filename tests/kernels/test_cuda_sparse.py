"""The CUDA member of the sparse FFN kernels (kernels/cuda_sparse.py) against the plain-ops
reference on the same vectors as the CPU and Metal members: both down layouts, bits, group sizes,
scale types, token counts and active counts 0, 1, some and all. Needs an NVIDIA GPU; skipped
elsewhere with the reason."""

import numpy as np
import pytest

from mlx_flash.kernels.slab_spec import ScaleType
from mlx_flash.kernels.sparse_ffn_ref import random_slab, sparse_down_ref, sparse_gate_up_ref

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is false)", allow_module_level=True)

from mlx_flash.kernels.cuda_sparse import CudaSparseFFN  # noqa: E402

SLOTS = 24
CASES = [  # (block, bits, gate/up group, down bits, down group, scale type, d_model)
    (32, 4, 32, 4, None, ScaleType.F16, 256),
    (32, 8, 64, 8, None, ScaleType.F16, 576),
    (32, 4, 128, 8, None, ScaleType.BF16, 256),
    (32, 8, 32, 4, None, ScaleType.F32, 256),
    (1, 4, 32, 8, 32, ScaleType.F16, 576),
    (1, 8, 64, 4, 64, ScaleType.F32, 256),
    (1, 4, 128, 4, 32, ScaleType.BF16, 256),
]


@pytest.mark.parametrize("block,bits,group,down_bits,down_group,scale_type,D", CASES)
@pytest.mark.parametrize("tokens", [1, 3, 10])
def test_cuda_kernel_equals_reference(block, bits, group, down_bits, down_group, scale_type, D, tokens):
    rng = np.random.default_rng(block + bits + group + tokens)
    slab, spec = random_slab(rng, SLOTS, D, block, bits, group, scale_type, down_bits, down_group)
    k = CudaSparseFFN(spec)
    dev = torch.device("cuda")
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    st = torch.from_numpy(slab).to(dev)
    for count in (0, 1, 7, SLOTS):
        idx = rng.permutation(SLOTS).astype(np.int32)
        h_ref = sparse_gate_up_ref(x, slab, idx, count, spec)
        y_ref = sparse_down_ref(h_ref, slab, idx, count, spec)
        it, ct = torch.from_numpy(idx).to(dev), torch.tensor([count], dtype=torch.int32, device=dev)
        h = k.gate_up(torch.from_numpy(x).to(dev), st, it, ct).cpu().numpy()
        assert h.shape == (tokens, SLOTS * block) and not h[:, count * block :].any()
        h_in = np.zeros((tokens, SLOTS * block), np.float32)
        h_in[:, : count * block] = h_ref
        y = k.down(torch.from_numpy(h_in).to(dev), st, it, ct).cpu().numpy()
        if count == 0:
            assert not y.any()
            continue
        eh = np.abs(h[:, : count * block] - h_ref).max() / np.abs(h_ref).max()
        ey = np.abs(y - y_ref).max() / np.abs(y_ref).max()
        assert eh < 1e-5 and ey < 1e-5, f"count={count}: relative errors {eh:.1e} {ey:.1e}"


def test_refuses_a_cpu_slab():
    rng = np.random.default_rng(0)
    slab, spec = random_slab(rng, 4, 256, 32)
    k = CudaSparseFFN(spec)
    with pytest.raises(RuntimeError, match="slab must be"):
        k.gate_up(
            torch.zeros((1, 256), device="cuda"),
            torch.from_numpy(slab),
            torch.zeros(4, dtype=torch.int32, device="cuda"),
            torch.ones(1, dtype=torch.int32, device="cuda"),
        )
