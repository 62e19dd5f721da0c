"""The torch operators stored_matmul and moe_experts on CUDA tensors (cuda/ops_cuda.cpp over the
affine product of cuda/qmatmul.cu): implementations for torch's CUDA dispatch key of the schemas the CPU kernels'
operators define (torch_ops.py, loaded first), built at first use for the present GPU's
architecture into the cache (MLX_FLASH_CACHE or ~/.cache/mlx_flash, cuda_ext/<hash>;
extension_build.py), loaded once per process. Without a CUDA device nothing is built and
KernelUnavailableError says why, as it does for a failed build, in one line. torch is imported only
inside functions.
"""

from __future__ import annotations

import os

import numpy as np

from mlx_flash.config import default_cache_dir

from . import torch_ops
from .extension_build import build, cuda_arch_flag, cuda_torch
from .qmatmul import StoredMatrix
from .stored_operands import operands

SOURCES = (
    ("cuda", "ops_cuda.cpp"),
    ("cuda", "qmatmul.cu"),
    ("cuda", "qmatmul.cuh"),
    ("cuda", "affine.cuh"),
    ("torch", "check_text.h"),
    ("torch", "moe_table.h"),
)  # (folder, file)
CUDA_BITS = (2, 4, 8)  # code widths qmatmul.cu reads (its groups: multiples of 32 codes)
_ALIGN = 256  # each part of a matrix starts at this byte offset multiple of its device buffer
_LOADED = False


def ops():
    """torch.ops.mlx_flash, its stored_matmul taking CUDA tensors too (built on first use)."""
    global _LOADED
    if not _LOADED:
        what = "the CUDA stored product"
        torch = cuda_torch(what, "the CPU kernel's operators (torch_ops.py) run elsewhere")
        torch_ops.ops()  # the schema the CUDA implementation registers under
        arch, sm = cuda_arch_flag(torch)
        build(
            what,
            "mf_cuda_ops",
            os.path.join(default_cache_dir(), "cuda_ext"),
            list(SOURCES),
            ["ops_cuda.cpp", "qmatmul.cu"],
            f"{torch.__version__} {sm}",
            cuda_flags=[arch],
            python_module=False,
            note="once per torch version and GPU; about a minute",
        )
        _LOADED = True
    return torch_ops.ops()


def readable(bits: int, group: int) -> bool:
    """Whether qmatmul.cu reads a matrix of this code width and group size."""
    return bits in CUDA_BITS and group % 32 == 0


def scale_dtype(scale_type: int):
    """The torch dtype of a scale type (cpu/qmatmul.h's ScaleType: 0 float16, 1 bfloat16, 2 float32)."""
    import torch

    return (torch.float16, torch.bfloat16, torch.float32)[scale_type]


class CudaMatrix:
    """A plain affine StoredMatrix's bytes moved once to a CUDA device (codes, scales and biases in one
    uint8 tensor: a copy of the bytes, never of floats) and multiplied there by stored_matmul:
    `__call__(x)` is x [.., K] float32 on that device times it. `parts()`: the three parts as tensors
    of their stored types viewing that buffer (what embedding lookups dequantize rows of)."""

    def __init__(self, matrix: StoredMatrix, device):
        import torch

        self.ops = ops()
        op = operands(matrix)
        st, bits, group = op.quant
        if op.layout or not readable(bits, group):
            raise ValueError(
                f"the CUDA stored product takes plain matrices of {CUDA_BITS}-bit codes in groups of a "
                f"multiple of 32 (got {bits}-bit, group {group}{', laid out' if op.layout else ''})"
            )
        self.quant, self.n_out, self.transposed = op.quant, op.n_out, op.transposed
        self.shapes = [a.shape for a in op.views]
        self.offsets, size = [], 0
        for a in op.views:
            self.offsets.append(size)
            size += -(-a.nbytes // _ALIGN) * _ALIGN
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        for a, o in zip(op.views, self.offsets):
            self.buffer[o : o + a.nbytes].copy_(torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
        self.spec = op.spec(self.offsets)  # the matrix as moe_experts' table takes it (stored_operands)

    def __call__(self, x):
        st, bits, group = self.quant
        w, s, b = self.offsets
        return self.ops.stored_matmul(x, self.buffer, 0, w, s, b, st, bits, group, self.n_out, self.transposed, [], 1)

    def parts(self) -> tuple:
        """(codes as int32 words, scales, biases), views of the device buffer shaped as stored."""
        import torch

        dtypes = (torch.int32, scale_dtype(self.quant[0]), scale_dtype(self.quant[0]))
        out = []
        for shape, o, dt in zip(self.shapes, self.offsets, dtypes):
            n = int(np.prod(shape)) * dt.itemsize
            out.append(self.buffer[o : o + n].view(dt).reshape(shape))
        return tuple(out)
