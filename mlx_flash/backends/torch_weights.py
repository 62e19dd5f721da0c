"""Weights of the torch backend, as methods of TorchOps: the `Weight` record a linear or an embedding
takes, and how one is built from a store's parts: dense (float32, or half precision on CUDA in the
fast mode), the stored quantized bytes computed on in place by the CPU or CUDA kernel, GGUF block rows
on the CPU block kernel, or packed for torch's int4 kernel (backends/torch.py says which mode does what)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..kernels import cuda_ops, torch_ops
from ..kernels.qmatmul import KERNEL_BITS, Arith, StoredMatrix
from ..quant_spec import QuantSpec
from . import block_matrix
from .thresholded import Thresholded, channel_major, over_kernel
from .torch_quant import dequantize, int4pack, unpack_bits

try:
    import torch
except ImportError:  # the torch backend says what to install (TorchOps refuses to start without it)
    torch = None


@dataclass
class Weight:
    # "dense"; "stored" (the store's packed codes, computed on by the CPU or CUDA kernel); "int4"
    # (packed for torch's int4 kernel); "int4x2" (8-bit as two 4-bit halves)
    kind: str
    w: "torch.Tensor"  # int4: packed; dense: [out, in] in the matmul dtype
    scale_zeros: "torch.Tensor | None"
    group_size: int
    out_features: int
    bias: "torch.Tensor | None"
    # The stored quantized triple, kept for embedding lookups (rows dequantized on demand).
    q: tuple | None = None
    quant: QuantSpec | None = None
    # "stored": the CPU kernel's view of q's memory (checked once at load; None on CUDA), and the
    # operator that multiplies by it
    matrix: StoredMatrix | None = None
    op: "torch_ops.TorchMatrix | cuda_ops.CudaMatrix | None" = None


def weight(self, parts: dict, quant: QuantSpec | None, transposed: bool = False, dtypes: dict | None = None) -> Weight:
    dtypes = dtypes or {}
    bias = self.array(parts["bias"], dtypes.get("bias")) if parts.get("bias") is not None else None
    if quant is None:
        w = self.array(parts["weight"], dtypes.get("weight"), cast=False)
        # A transposed weight stays a view: linear() multiplies by its transpose, i.e. by the
        # stored rows themselves, so copying it into the other layout would only cost time.
        w = (w.t() if transposed else w).to(self.mm_dtype)
        return Weight("dense", w, None, 0, w.shape[0], bias)
    if quant.is_block:  # GGUF block rows: the CPU block kernel, float32 activations
        if not self.stored_kernel:
            raise ConfigError(
                f"{quant.kind} weights run on the CPU block kernel, with float32 activations; "
                f"this torch backend ({self.describe()}) has no kernel for them yet"
            )
        matrix = block_matrix(parts["weight"], quant, transposed)
        return Weight(
            "stored",
            None,
            None,
            quant.group_size,
            matrix.n_out,
            bias,
            (matrix.raw,),
            quant,
            matrix,
            torch_ops.TorchMatrix(matrix, self.kernel_threads, self.arith),
        )
    if (self.stored_kernel and quant.bits in KERNEL_BITS) or (
        self.cuda_kernel and cuda_ops.readable(quant.bits, quant.group_size)
    ):
        return self._stored(parts, quant, transposed, dtypes, bias)
    packed = torch.from_numpy(np.ascontiguousarray(parts["weight"]).view(np.int32)).to(self.device)
    scales = self.array(parts["scales"], dtypes.get("scales"))
    biases = self.array(parts["biases"], dtypes.get("biases"))
    q = (packed, scales, biases)
    if self.int4_kernel and not transposed and quant.bits in (4, 8):
        packed_w = int4pack(unpack_bits(packed, quant.bits).to(torch.int32), scales, biases, quant)
        if packed_w is not None:
            kind, w4, sz = packed_w
            return Weight(kind, w4, sz, quant.group_size, scales.shape[0], bias, q, quant)
    w = dequantize(packed, scales, biases, quant, self.mm_dtype)
    w = w.t() if transposed else w
    # Keep the packed triple only where the dense copy is rounded (half precision on CUDA), so
    # embedding lookups stay exact; a float32 copy already is exact and the triple is dead weight.
    keep = q if self.mm_dtype != self.act_dtype else None
    return Weight("dense", w, None, 0, w.shape[0], bias, keep, quant)


def stored(self, parts: dict, quant: QuantSpec, transposed: bool, dtypes: dict, bias) -> Weight:
    """The stored triple as it is: on the CPU torch tensors sharing its memory and numpy views for
    the kernel; on CUDA its bytes copied once to the device, the tensors views of them."""
    words = np.ascontiguousarray(parts["weight"]).view(np.uint32)
    scales, biases = np.ascontiguousarray(parts["scales"]), np.ascontiguousarray(parts["biases"])
    bf16 = dtypes.get("scales") == "bfloat16"
    matrix = StoredMatrix(words, scales, biases, quant.bits, quant.group_size, not transposed, bf16)
    if self.cuda_kernel:  # the host arrays are not kept: the device holds the bytes
        op = cuda_ops.CudaMatrix(matrix, self.device)
        q = op.parts()
        return Weight("stored", q[0], None, quant.group_size, op.n_out, bias, q, quant, None, op)
    q = (
        torch.from_numpy(words.view(np.int32)),
        self.array(scales, dtypes.get("scales"), cast=False),
        self.array(biases, dtypes.get("biases"), cast=False),
    )
    return Weight(
        "stored",
        q[0],
        None,
        quant.group_size,
        matrix.n_out,
        bias,
        q,
        quant,
        matrix,
        torch_ops.TorchMatrix(matrix, self.kernel_threads, self.arith),
    )


def kernel_weight(self, matrix: StoredMatrix, quant: QuantSpec) -> Weight:
    """A weight the CPU kernel multiplies where its bytes lie (a StoredMatrix over laid-out rows,
    e.g. inside a layer's bundles, or a BlockMatrix of GGUF block rows): no tensor of it exists, so
    it cannot be looked up as an embedding."""
    if not self.stored_kernel:
        raise ConfigError(
            f"{quant.kind or f'{quant.bits}-bit'} weights laid out in bundles run on the CPU kernel, "
            f"with float32 activations; this torch backend ({self.describe()}) has none"
        )
    return Weight(
        "stored",
        None,
        None,
        quant.group_size,
        matrix.n_out,
        None,
        None,
        quant,
        matrix,
        torch_ops.TorchMatrix(matrix, self.kernel_threads, self.arith),
    )


def matmul_only(self, w: Weight) -> Weight:
    """The weight without the stored triple kept for embedding lookups (a weight only multiplied)."""
    return dataclasses.replace(w, q=None)


def thresholded(self, w: Weight, threshold: float, every_row: bool) -> Thresholded:
    """`w` behind an activation threshold (backends/thresholded.py): over the channel-major kernel
    where this backend has it for the weight (the CPU kernel, exact arithmetic: the layout then
    replaces the stored one), else the masked reference."""
    cm = None
    if self.stored_kernel and self.arith is Arith.EXACT:
        cm = channel_major(w.matrix, torch_ops.framework_buffer, self.kernel_threads)
    if cm is None:
        return Thresholded(threshold, every_row, 0, w.out_features, inner=w)
    return over_kernel(cm, torch_ops.TorchChannelMajor(cm, self.kernel_threads), threshold, every_row, w.bias)
