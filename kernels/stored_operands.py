"""What a framework operator needs of a stored matrix (a StoredMatrix or BlockMatrix, checked when it
was built): the kernel's attributes, and the memory its parts lie in as one buffer with byte offsets.
Framework-neutral (numpy only): the MLX primitives (mlx_kernels.py) and the torch operators
(torch_ops.py) turn the buffer into their own array without copying it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from .blockmatmul import BlockMatrix
from .qmatmul import Arith, StoredMatrix, q8_reads


class Listed(IntEnum):
    """What a sparse product's ids name (kernels/cpu/qmatmul.h): rows (blocks of output rows, or input
    rows) or groups (the groups of a groups-apart down matrix); the operators' `listed` argument."""

    NONE = 0
    ROWS = 1
    GROUPS = 2

    @classmethod
    def of(cls, sparse_axis: str | None) -> "Listed":
        """What a matrix's sparse products list (Operands.sparse_axis)."""
        return cls.GROUPS if sparse_axis == "groups" else cls.ROWS


@dataclass(frozen=True)
class Operands:
    kind: int  # 0: affine groups; else a GGUF block type
    quant: tuple  # (scale type, bits, group): affine only, else zeros
    layout: list  # [] for a plain matrix, else the kernel's row layout (7 or 4 ints)
    n_out: int
    k_in: int
    transposed: bool  # rows are outputs
    sparse_axis: str | None  # what sparse products list: "blocks", "groups", "rows" or None
    rpb: int  # rows per block (laid-out rows), else 1
    views: tuple  # where the kernel starts reading each part: (codes, scales, biases) or (raw,)

    def sparse_output(self, n: int) -> tuple[int, "Listed"]:
        """(output width, what is listed) of a sparse product over n listed units: n blocks of rpb
        rows, else the whole output (listed groups or rows of the input)."""
        return (n * self.rpb if self.sparse_axis == "blocks" else self.n_out), Listed.of(self.sparse_axis)

    def spec(self, offsets, arith: Arith = Arith.EXACT) -> list[int]:
        """The matrix as the whole-layer operators take it (kernels/cpu/matrix_ref.h): kind, the byte
        offsets of its parts in their buffer, scale type, bits, group, outputs, transposed, arithmetic,
        layout."""
        w, s, b = (tuple(offsets) + (0, 0, 0))[:3]
        return [self.kind, w, s, b, *self.quant, self.n_out, int(self.transposed), int(arith), *self.layout]

    def arithmetic(self, asked: Arith) -> Arith:
        """The arithmetic a product of this matrix runs when `asked` is asked for: q8 only where its
        kernels read the matrix (qmatmul.q8_reads), else the float arithmetic."""
        if asked is Arith.Q8 and q8_reads(self.kind, self.quant[1], self.quant[2], self.transposed):
            return Arith.Q8
        return Arith.EXACT


def operands(matrix: StoredMatrix | BlockMatrix) -> Operands:
    layout = [] if matrix.layout is None else [int(v) for v in matrix.layout]
    if isinstance(matrix, BlockMatrix):
        return Operands(
            matrix.block.ggml_type, (0, 0, 0), layout, matrix.n_out, matrix.k_in, True, None, 1, (matrix.raw,)
        )
    rpb = layout[0] if layout else 1
    return Operands(
        0,
        (matrix.scale_type, matrix.bits, matrix.group),
        layout,
        matrix.n_out,
        matrix.k_in,
        matrix.rows_are_outputs,
        matrix.sparse_axis,
        rpb,
        matrix.parts,
    )


def layer_specs(matrices, n: int | None = None) -> tuple[list, list[int]]:
    """For a whole-layer operation over operators of stored matrices (each with `op`, its Operands, and
    `spec`; None for a missing one, e.g. up when gate holds gate|up, which gives []): each matrix's
    spec and, for a sparse layer over n listed units, what each lists (Listed), its spec's output
    width that of its sparse product; dense (n None): no lists."""
    if n is None:
        return [m.spec if m is not None else [] for m in matrices], []
    specs, listed = [], []
    for m in matrices:
        if m is None:
            specs.append([])
            listed.append(0)
            continue
        width, what = m.op.sparse_output(n)
        spec = list(m.spec)
        spec[7] = width  # the output width (Operands.spec's order)
        specs.append(spec)
        listed.append(int(what))
    return specs, listed


def owner(view: np.ndarray) -> np.ndarray:
    """The numpy array that owns the memory `view` lies in (the start of its chain of views)."""
    while isinstance(view.base, np.ndarray):
        view = view.base
    return view


def one_buffer(views) -> tuple[np.ndarray, list[int], bool]:
    """One uint8 buffer holding every view's memory, each view's byte offset in it, and whether it is
    the views' own memory: the memory they share when they share one owner (no copy), else a copy of
    each owner, back to back (views of separate arrays: tests build matrices so)."""
    owners = {id(owner(v)): owner(v) for v in views}
    if len(owners) == 1:
        (o,) = owners.values()
        if o.flags.c_contiguous:
            return o.reshape(-1).view(np.uint8), [v.ctypes.data - o.ctypes.data for v in views], True
    at, size = {}, 0
    for k, o in owners.items():
        at[k] = size
        size += -(-o.nbytes // 64) * 64
    buf = np.empty(size, np.uint8)
    for k, o in owners.items():
        buf[at[k] : at[k] + o.nbytes] = np.ascontiguousarray(o).reshape(-1).view(np.uint8)
    return buf, [at[id(owner(v))] + (v.ctypes.data - owner(v).ctypes.data) for v in views], False
