"""The Metal product over GGUF block rows (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): y = x · Wᵀ with W kept as
the store holds it (row n = output n, a run of whole blocks), one kernel body,
metal/block_matmul.metal (decoding in metal/block_common.h), compiled at run time through
mx.fast.metal_kernel and equal to the plain-ops reference gguf_blocks_ref.block_matmul_ref.

The launch arguments (template, grid, threadgroup, output shapes) come from the framework-neutral
functions below, which the tests also hand to metal_cpu.py to run the same body on a CPU. Nothing
here imports mlx at module level.
"""

from __future__ import annotations

import numpy as np

from mlx_flash.errors import KernelUnavailableError

from .gguf_blocks_ref import BLOCKS, GgufBlock
from .metal_sparse import SIMD, built_kernel
from .mlx_kernels import framework_array

MAX_TOKENS = 8  # per pass over a row (register accumulators); a launch makes as many passes as it needs
SIMDGROUPS = 4  # SIMD groups (rows) per threadgroup
MAX_ROWS = 16384  # SIMD groups launched at most; each loops over rows past that

KERNEL = "block_matmul"
INPUTS, OUTPUTS = ("x", "w"), ("y",)
HEADER = "block_common.h"


def block_of(kind: str) -> GgufBlock:
    if kind not in BLOCKS:
        raise ValueError(f"block kind {kind!r} is not one of {', '.join(BLOCKS)}")
    return BLOCKS[kind]


def check_rows(kind: str, w_shape) -> tuple[int, int]:
    """(K, N) of rows w [N, row bytes] of `kind`, or a ValueError naming the mismatch."""
    blk = block_of(kind)
    if len(w_shape) != 2 or w_shape[0] < 1 or w_shape[1] < 1 or w_shape[1] % blk.nbytes:
        raise ValueError(f"{kind} rows are [N, whole {blk.nbytes}-byte blocks] (got {tuple(w_shape)})")
    return w_shape[1] // blk.nbytes * blk.weights, w_shape[0]


def check_operands(kind: str, x_shape, w_shape) -> tuple[int, int, int]:
    """(T, K, N) of x [T, K] times rows w [N, row bytes] of `kind`, or a ValueError naming the mismatch."""
    k_in, n_out = check_rows(kind, w_shape)
    if len(x_shape) != 2 or x_shape[1] != k_in:
        raise ValueError(f"x must be [T, {k_in}] for {kind} rows of {w_shape[1]} bytes (got {tuple(x_shape)})")
    return x_shape[0], k_in, n_out


def launch(kind: str, tokens: int, n_out: int, out_dtype, max_rows: int = MAX_ROWS) -> dict:
    """Call arguments of block_matmul for x [tokens, K] over n_out rows (but the output dtype, which
    `out_dtype` also names in the template: the framework's float16 or float32 dtype)."""
    if tokens < 1 or n_out < 1:
        raise ValueError(f"a launch needs tokens and rows (got {tokens} tokens, {n_out} rows)")
    template = [("KIND", block_of(kind).ggml_type), ("TT", min(tokens, MAX_TOKENS)), ("OT", out_dtype)]
    return {
        "template": template,
        "grid": (SIMD, max(1, min(n_out, max_rows)), 1),
        "threadgroup": (SIMD, SIMDGROUPS, 1),
        "output_shapes": [(tokens, n_out)],
        "init_value": None,
    }


def plain_rows(matrix) -> np.ndarray:
    """A resident BlockMatrix's bytes as plain rows, uint8 [N, row bytes] C-contiguous (what the kernel
    reads): the matrix's own array when it already is that, else a byte copy without the row stride.
    Rows inside a layer's bundles are refused: they stay where the read put them (so the layer can
    stream) for the CPU block kernel."""
    if matrix.layout is None:
        return matrix.raw
    if matrix.raw.ndim == 2:  # plain rows with a row stride
        return np.ascontiguousarray(matrix.raw)
    raise ValueError(
        "block rows inside a layer's bundles are multiplied in place by the CPU block kernel, "
        "not copied for the Metal one"
    )


def _metal_kernel():
    return built_kernel(KERNEL, INPUTS, OUTPUTS, HEADER)


class MetalBlockMatmul:
    """x [.., K] times a block-kind weight on the GPU, as a node of MLX's graph. `raw`: the rows as a
    uint8 mx.array [N, row bytes], a byte copy of the stored rows made once (`of` makes it)."""

    name = "metal"

    def __init__(self, raw, kind: str):
        import mlx.core as mx

        if not mx.metal.is_available():
            raise KernelUnavailableError(
                "the Metal block kernel needs a Metal GPU (mx.metal.is_available() is false); "
                "use the CPU block kernel (blockmatmul.BlockMatrix)"
            )
        if raw.dtype != mx.uint8:
            raise ValueError(f"block rows are a uint8 array (got {raw.dtype})")
        self.k_in, self.n_out = check_rows(kind, raw.shape)
        self.raw, self.kind = raw, kind

    @classmethod
    def of(cls, matrix) -> "MetalBlockMatmul":
        """Over a BlockMatrix's rows as an mx.array the GPU reads: where the read put them when that is
        MLX memory (unified on a Mac), else copied once as bytes (never a float copy)."""

        return cls(framework_array(plain_rows(matrix)), matrix.kind)

    def __call__(self, x):
        """x [.., K] float16 or float32 (others computed in float32) -> [.., N] in that dtype."""
        import mlx.core as mx

        lead = x.shape[:-1]
        if x.dtype not in (mx.float16, mx.float32):
            x = x.astype(mx.float32)
        x2 = x.reshape(-1, x.shape[-1])
        T, _, N = check_operands(self.kind, x2.shape, self.raw.shape)
        if T == 0:
            return mx.zeros((*lead, N), dtype=x.dtype)
        y = _metal_kernel()(inputs=[x2, self.raw], output_dtypes=[x.dtype], **launch(self.kind, T, N, x.dtype))[0]
        return y.reshape(*lead, N)
