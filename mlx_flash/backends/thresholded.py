"""A product whose small inputs count as zero (TEAL activation sparsity): input channels whose
magnitude is at or below a threshold are skipped, their weights neither read nor multiplied.

Both backends take a `Thresholded` wherever a linear's weight goes (`ops.linear` hands it to
`product`). Where the backend has the channel-major kernel for the weight (kernels/channel_major.py:
4- and 8-bit affine matrices on the CPU), the weight lives only in that layout, the same codes and
scales reordered so each input channel's codes lie together, and the kernel skips whole channels
(and a group's scales when none of its channels is active). Elsewhere (GGUF block kinds, CUDA,
Metal) the product is the plain-ops reference: the input masked, then the backend's own product,
which computes the same values and reads every byte.

Which rows are thresholded: one-row steps (a decode step of one sequence) always; rows of a prompt
or of several sequences only with `every_row` (what the quality figures measure: every token of a
text scored as decode would compute it). Other multi-row steps run the dense product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ffn_source import GateActivation
from ..kernels.channel_major import ChannelMajorMatrix, cm_bytes
from ..kernels.qmatmul import StoredMatrix

DENSE = -1.0  # the kernels' threshold for "every channel active"


@dataclass
class Thresholded:
    """One product behind its threshold: what `ops.thresholded` makes of a weight (n_in inputs,
    out_features outputs), multiplied by `product`."""

    threshold: float
    every_row: bool
    n_in: int
    out_features: int
    inner: Any = None  # the backend's weight: the reference path's product (None where `kernel` holds the bytes)
    kernel: Any = None  # callable (x, threshold) -> x @ W^T over the channel-major bytes, or None
    bias: Any = None  # added after the kernel's product (the reference path's inner weight adds its own)
    channel_bytes: int = 0  # bytes of one input channel's codes in the layout (all outputs)
    group_bytes: int = 0  # bytes of one group's scales and biases in the layout (all outputs)
    group: int = 0  # input channels sharing a scale

    def product(self, ops, x):
        t = self.threshold if (self.every_row or math.prod(x.shape[:-1]) == 1) else DENSE
        if self.kernel is None:
            return ops.linear(x * (abs(x) > t), self.inner) if t >= 0 else ops.linear(x, self.inner)
        y = self.kernel(x, t)
        return y + self.bias if self.bias is not None else y

    def counts(self) -> np.ndarray | None:
        """int64 [3] the kernel counted over its thresholded products (rows, active channels, active
        groups, summed over rows), or None on the reference path, which counts nothing."""
        return None if self.kernel is None else np.asarray(self.kernel.counters, dtype=np.int64)

    @property
    def dense_bytes(self) -> int:
        """Bytes one row's dense product reads (codes, scales and biases)."""
        return self.n_in * self.channel_bytes + (self.n_in // max(self.group, 1)) * self.group_bytes


def channel_major(matrix, buffer, threads: int) -> ChannelMajorMatrix | None:
    """`matrix` rewritten into the channel-major layout in memory from `buffer(nbytes)` (the backend's
    own), where the kernel takes it: a StoredMatrix whose rows are outputs, of a width and group the
    kernel reads (else None: the masked reference)."""
    if not isinstance(matrix, StoredMatrix) or not matrix.rows_are_outputs:
        return None
    try:
        cm_bytes(matrix.n_out, matrix.k_in, matrix.bits, matrix.group, matrix.scale_type)
    except ValueError:  # a width or group the layout does not take
        return None
    return ChannelMajorMatrix.from_stored(matrix, buffer, threads)


def over_kernel(cm: ChannelMajorMatrix, op, threshold: float, every_row: bool, bias) -> Thresholded:
    """A Thresholded whose products are `op` (the backend's operator over cm's bytes)."""
    return Thresholded(
        threshold,
        every_row,
        cm.k_in,
        cm.n_out,
        kernel=op,
        bias=bias,
        channel_bytes=cm.channel_bytes,
        group_bytes=cm.group_bytes,
        group=cm.group,
    )


def thresholded_ffn(act: GateActivation, gate_up, down, x, fused):
    """down(act(gate) * up) of x by `fused` (the backend's cm_gated_ffn: one call, equal to the three
    products and the activation to the bit) where gate|up (one weight, or gate and up) and down are
    Thresholded over the kernel without biases, and the FFN is SwiGLU; else None."""
    parts = gate_up if isinstance(gate_up, tuple) else (gate_up,)
    if act is not GateActivation.SILU or len(parts) > 2:
        return None
    if not all(isinstance(w, Thresholded) and w.kernel is not None and w.bias is None for w in (*parts, down)):
        return None
    on = down.every_row or math.prod(x.shape[:-1]) == 1
    up = parts[1].kernel if len(parts) == 2 else None
    t_gu, t_down = (parts[0].threshold, down.threshold) if on else (DENSE, DENSE)
    return fused(x, parts[0].kernel, down.kernel, t_gu, t_down, up=up)
