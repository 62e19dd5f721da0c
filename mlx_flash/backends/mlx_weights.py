"""The weights of the MLX backend, as methods of MLXOps: a linear layer's stored parts made into a
`Weight` for the path that multiplies them here (mx.quantized_matmul on the GPU, our Metal kernel for
GGUF block kinds there, our CPU kernel's primitives over the stored bytes on the CPU), and a weight
over rows laid out elsewhere (a layer's bundles) that the CPU kernel multiplies where they lie."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..kernels import mlx_kernels
from ..kernels.metal_blocks import MetalBlockMatmul
from ..kernels.qmatmul import KERNEL_BITS, Arith, StoredMatrix
from ..quant_spec import QuantSpec
from . import block_matrix
from .thresholded import Thresholded, channel_major, over_kernel


@dataclass
class Weight:
    """A linear layer's weight. `transposed` means stored [in, out] (bundle rows of down columns)."""

    w: mx.array | None
    scales: mx.array | None
    biases: mx.array | None
    bias: mx.array | None
    quant: QuantSpec | None
    transposed: bool
    # CPU: the stored (words, scales, biases, bfloat16 scales?) as numpy arrays, and no mx copies, the
    # kernel's view of them (checked once at load) and its graph operation
    stored: tuple | None = None
    matrix: StoredMatrix | None = None
    graph: mlx_kernels.GraphMatrix | None = None
    metal: MetalBlockMatmul | None = None  # GPU, GGUF block kinds: the Metal product over a byte copy


def weight(self, parts: dict, quant: QuantSpec | None, transposed: bool = False, dtypes: dict | None = None) -> Weight:
    """A linear's Weight from its stored numpy parts ("weight", and "scales"/"biases" when quantized,
    "bias"); transposed: stored [in, out]; dtypes: a part's stored dtype by key."""
    dtypes = dtypes or {}
    if quant is None:
        return Weight(
            self.array(parts["weight"], dtypes.get("weight")),
            None,
            None,
            _opt(self, parts, "bias", dtypes),
            None,
            transposed,
        )
    if quant.is_block:  # GGUF block rows: the Metal block kernel on a GPU, the CPU block kernel elsewhere
        matrix, metal = block_matrix(parts["weight"], quant, transposed), None
        if self.on_gpu:  # the rows as the GPU reads them (in place when MLX memory); embedding rows read those
            metal = MetalBlockMatmul.of(matrix)
            matrix = block_matrix(np.asarray(metal.raw), quant, False)
        return Weight(
            None,
            None,
            None,
            _opt(self, parts, "bias", dtypes),
            quant,
            False,
            (matrix.raw,),
            matrix,
            mlx_kernels.GraphMatrix(matrix, self.kernel_threads, self.arith),
            metal,
        )
    if not self.on_gpu and quant.bits in KERNEL_BITS:
        stored = (
            np.ascontiguousarray(parts["weight"]).view(np.uint32),
            np.ascontiguousarray(parts["scales"]),
            np.ascontiguousarray(parts["biases"]),
            dtypes.get("scales") == "bfloat16",
        )
        matrix = StoredMatrix(*stored[:3], quant.bits, quant.group_size, not transposed, stored[3])
        return Weight(
            None,
            None,
            None,
            _opt(self, parts, "bias", dtypes),
            quant,
            transposed,
            stored,
            matrix,
            mlx_kernels.GraphMatrix(matrix, self.kernel_threads, self.arith),
        )
    # Scales/biases in the activation dtype: quantized_matmul wants one float type throughout.
    return Weight(
        mx.array(parts["weight"]),
        self.array(parts["scales"], dtypes.get("scales")),
        self.array(parts["biases"], dtypes.get("biases")),
        _opt(self, parts, "bias", dtypes),
        quant,
        transposed,
    )


def kernel_weight(self, matrix: StoredMatrix, quant: QuantSpec) -> Weight:
    """A weight the CPU kernel multiplies where its bytes lie (a StoredMatrix over laid-out rows,
    e.g. inside a layer's bundles); not usable as an embedding. On a GPU too: GGUF block rows in a
    layer's bundles stay where the read put them (so such layers can stream), multiplied by the CPU
    primitive; resident block weights (weight()) take the Metal kernel."""
    # () : no arrays of its own to count
    return Weight(
        None,
        None,
        None,
        None,
        quant,
        False,
        (),
        matrix,
        mlx_kernels.GraphMatrix(matrix, self.kernel_threads, self.arith),
    )


def _opt(ops, parts, key, dtypes):
    return ops.array(parts[key], dtypes.get(key)) if parts.get(key) is not None else None


def matmul_only(self, w: Weight) -> Weight:
    """A weight only multiplied: MLX keeps nothing extra for embedding lookups."""
    return w


def thresholded(self, w: Weight, threshold: float, every_row: bool) -> Thresholded:
    """`w` behind an activation threshold (backends/thresholded.py): over the channel-major kernel
    where this backend has it for the weight (a CPU primitive, exact arithmetic: the layout then
    replaces the stored one), else the masked reference."""
    cm = None
    if not self.on_gpu and self.arith is Arith.EXACT:
        cm = channel_major(w.matrix, mlx_kernels.framework_buffer, self.kernel_threads)
    if cm is None:
        return Thresholded(threshold, every_row, 0, 0, inner=w)
    return over_kernel(cm, mlx_kernels.GraphChannelMajor(cm, self.kernel_threads), threshold, every_row, w.bias)
