"""The CUDA member of the sparse FFN kernels (sparse_ffn.py states the protocol): cuda/sparse_ffn.cu
(plain CUDA C++) and its torch binding cuda/sparse_ffn_torch.cpp, built with
torch.utils.cpp_extension at first use for the present GPU's architecture into the cache
(MLX_FLASH_CACHE or ~/.cache/mlx_flash, cuda_ext/<hash>; extension_build.py), loaded once per
process. Nothing falls back silently: without a CUDA device, or when the build fails,
KernelUnavailableError says why. torch is imported only inside functions.
"""

from __future__ import annotations

import os

from mlx_flash.config import default_cache_dir

from .extension_build import build, cuda_arch_flag, cuda_torch
from .slab_spec import SlabSpec

SOURCES = (
    ("cuda", "sparse_ffn.cu"),
    ("cuda", "sparse_ffn.cuh"),
    ("cuda", "affine.cuh"),
    ("torch", "check_text.h"),
    ("cuda", "sparse_ffn_torch.cpp"),
)  # (folder, file)
MAX_TOKENS = 8  # per launch (kMaxTokens in sparse_ffn.cuh); more tokens run as several launches
_EXT = None


def spec_ints(spec: SlabSpec) -> list[int]:
    """The spec as the binding takes it: d_model, block, row_bytes, (w, s, b, bits, group) of gate, up
    and down, down layout, scale type."""
    out = [spec.d_model, spec.block, spec.row_bytes]
    for m in (spec.gate, spec.up, spec.down):
        out += [m.w, m.s, m.b, m.bits, m.group]
    return out + [int(spec.down_layout), int(spec.scale_type)]


def extension():
    """The compiled binding (built on first use, then loaded from the cache)."""
    global _EXT
    if _EXT is None:
        torch = cuda_torch("the CUDA sparse FFN kernels", "the CPU kernel (sparse_ffn.CpuSparseFFN) runs elsewhere")
        arch, sm = cuda_arch_flag(torch)
        _EXT = build(
            "the CUDA sparse FFN kernels",
            "mf_sparse_ffn",
            os.path.join(default_cache_dir(), "cuda_ext"),
            list(SOURCES),
            ["sparse_ffn_torch.cpp", "sparse_ffn.cu"],
            f"{torch.__version__} {sm}",
            cuda_flags=[arch],
        )
    return _EXT


class CudaSparseFFN:
    """The CUDA member: gate_up and down over torch CUDA tensors (count an int32 tensor [1] on the
    device, read by the kernels, never by the host)."""

    name = "cuda"

    def __init__(self, spec: SlabSpec):
        self.spec, self.ext, self._spec = spec, extension(), spec_ints(spec)

    def _launches(self, fn, a, slab, idx, count):
        import torch

        stream = torch.cuda.current_stream(a.device).cuda_stream
        a, idx, count = a.float().contiguous(), idx.to(torch.int32).contiguous(), count.to(torch.int32).reshape(1)
        outs = [
            fn(a[i : i + MAX_TOKENS], slab, idx, count, self._spec, stream) for i in range(0, a.shape[0], MAX_TOKENS)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def gate_up(self, x, slab, idx, count):
        """x [T, D] -> h [T, S*block]: h[t, j*block + r] = silu(x·gate_r) * (x·up_r) of bundle idx[j]
        for j < count, 0 past count."""
        return self._launches(self.ext.gate_up, x, slab, idx, count)

    def down(self, h, slab, idx, count):
        """h [T, >= S*block] -> y [T, D] = sum over j < count of down(idx[j]) · h[:, j*block:(j+1)*block]."""
        return self._launches(self.ext.down, h, slab, idx, count)
