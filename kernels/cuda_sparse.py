"""The CUDA member of the sparse FFN kernels (sparse_ffn.py states the protocol): cuda/sparse_ffn.cu
(plain CUDA C++) and its torch binding cuda/sparse_ffn_torch.cpp, built with
torch.utils.cpp_extension at first use for the present GPU's architecture into the cache
(MLX_FLASH_CACHE or ~/.cache/mlx_flash, cuda_ext/<hash>), loaded once per process. Nothing falls
back silently: without a CUDA device, or when the build fails, KernelUnavailableError says why.
torch is imported only inside functions.
"""

from __future__ import annotations

import hashlib
import os
from importlib import resources

from mlx_flash.errors import KernelUnavailableError

from .slab_spec import SlabSpec

SOURCES = ("sparse_ffn.cu", "sparse_ffn.cuh", "sparse_ffn_torch.cpp")
MAX_TOKENS = 8  # per launch (kMaxTokens in sparse_ffn.cuh); more tokens run as several launches
_EXT = None


def spec_ints(spec: SlabSpec) -> list[int]:
    """The spec as the binding takes it: d_model, block, row_bytes, (w, s, b, bits, group) of gate, up
    and down, down layout, scale type."""
    out = [spec.d_model, spec.block, spec.row_bytes]
    for m in (spec.gate, spec.up, spec.down):
        out += [m.w, m.s, m.b, m.bits, m.group]
    return out + [int(spec.down_layout), int(spec.scale_type)]


def cuda_source(name: str) -> str:
    """A file of the cuda/ folder shipped in this package."""
    return resources.files("mlx_flash.kernels").joinpath("cuda", name).read_text()


def build_dir(key: str) -> str:
    root = os.environ.get("MLX_FLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mlx_flash")
    path = os.path.join(root, "cuda_ext", key)
    os.makedirs(path, exist_ok=True)
    return path


def extension():
    """The compiled binding (built on first use, then loaded from the cache)."""
    global _EXT
    if _EXT is not None:
        return _EXT
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        raise KernelUnavailableError("the CUDA sparse FFN kernels need torch (pip install "
                                     "'mlx-flash-engine[torch]')") from None
    if not torch.cuda.is_available():
        raise KernelUnavailableError("the CUDA sparse FFN kernels need an NVIDIA GPU (torch.cuda.is_available() is "
                                     "false); the CPU kernel (sparse_ffn.CpuSparseFFN) runs elsewhere")
    major, minor = torch.cuda.get_device_capability()
    texts = {name: cuda_source(name) for name in SOURCES}
    key = hashlib.sha256("".join(texts.values()).encode() + f"{torch.__version__} sm_{major}{minor}".encode())
    where = build_dir(key.hexdigest()[:16])
    for name, text in texts.items():  # the build reads files: copies of the shipped sources
        path = os.path.join(where, name)
        if not os.path.isfile(path) or open(path).read() != text:
            with open(path, "w") as fh:
                fh.write(text)
    arch = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
    try:
        _EXT = cpp_extension.load(name=f"mf_sparse_ffn_{key.hexdigest()[:8]}",
                                  sources=[os.path.join(where, "sparse_ffn_torch.cpp"), os.path.join(where, "sparse_ffn.cu")],
                                  extra_cuda_cflags=["-O3", arch], build_directory=where, verbose=False)
    except Exception as e:  # a compiler's many lines: the first one names it
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KernelUnavailableError(f"building the CUDA sparse FFN kernels in {where} failed: {first}") from None
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
        outs = [fn(a[i:i + MAX_TOKENS], slab, idx, count, self._spec, stream) for i in range(0, a.shape[0], MAX_TOKENS)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def gate_up(self, x, slab, idx, count):
        """x [T, D] -> h [T, S*block]: h[t, j*block + r] = silu(x·gate_r) * (x·up_r) of bundle idx[j]
        for j < count, 0 past count."""
        return self._launches(self.ext.gate_up, x, slab, idx, count)

    def down(self, h, slab, idx, count):
        """h [T, >= S*block] -> y [T, D] = sum over j < count of down(idx[j]) · h[:, j*block:(j+1)*block]."""
        return self._launches(self.ext.down, h, slab, idx, count)
