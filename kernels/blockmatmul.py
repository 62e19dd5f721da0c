"""The CPU block kernel (cpu/blockmatmul.cpp) from Python: float32 activations times a matrix kept in
a GGUF block quantization (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), computed on the stored bytes with no
dequantized copy. Framework-neutral like qmatmul.py, whose library (and thread pool) it shares."""

from __future__ import annotations

import numpy as np

from . import qmatmul
from .qmatmul import Arith
from .gguf_blocks_ref import BLOCKS, GgufBlock, dequantize


class BlockMatrix:
    """Rows (outputs) of blocks, checked once when built and multiplied many times.

    raw: uint8 [N, K / weights-per-block * block bytes], each row's bytes contiguous; rows may lie
    apart (any non-negative row stride: rows inside a larger buffer). The array is kept, not copied.
    `in_buffer` builds one over laid-out rows (inside a layer's bundles)."""

    def __init__(self, raw: np.ndarray, kind: str):
        blk = _block(kind)
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.strides[1] != 1 or raw.strides[0] < 0:
            raise ValueError(
                f"a block matrix is 2-D uint8 rows with contiguous bytes (got {raw.dtype} {raw.shape} "
                f"strides {raw.strides})"
            )
        if raw.shape[1] % blk.nbytes:
            raise ValueError(f"a {kind} row is whole {blk.nbytes}-byte blocks (got {raw.shape[1]} bytes)")
        layout = None if raw.flags.c_contiguous else (raw.shape[0], 0, raw.strides[0], blk.nbytes)
        self._setup(raw, kind, raw.shape[0], raw.shape[1] // blk.nbytes * blk.weights, layout)

    @classmethod
    def in_buffer(
        cls, buf: np.ndarray, offset: int, kind: str, n_out: int, k_in: int, rpb: int, wb: int, wr: int, wg: int
    ) -> "BlockMatrix":
        """Rows laid out in `buf` (C-contiguous uint8, kept alive): row n's block g at byte
        offset + (n // rpb) * wb + (n % rpb) * wr + g * wg (e.g. gate rows in blocks of neurons, one
        block per bundle, or a down matrix whose blocks are the bundles). Every byte it names must
        lie inside buf."""
        blk = _block(kind)
        if buf.dtype != np.uint8 or not buf.flags.c_contiguous:
            raise ValueError("a laid-out block matrix lies in a C-contiguous uint8 buffer")
        if min(n_out, k_in, rpb) < 1 or k_in % blk.weights or min(offset, wb, wr, wg) < 0:
            raise ValueError(
                f"bad layout for a {kind} matrix: n_out {n_out}, k_in {k_in}, rpb {rpb}, offset {offset}, "
                f"strides {wb}, {wr}, {wg}"
            )
        lastblock = (n_out - 1) // rpb  # the farthest row: the last one, or the last of the block before
        far = max(lastblock * wb + (n_out - 1) % rpb * wr, (lastblock - 1) * wb + (rpb - 1) * wr if lastblock else 0)
        last = offset + far + (k_in // blk.weights - 1) * wg
        if last + blk.nbytes > buf.nbytes:
            raise ValueError(
                f"the {kind} matrix's last block ends at byte {last + blk.nbytes}, past its buffer ({buf.nbytes} bytes)"
            )
        m = cls.__new__(cls)
        m._setup(buf.reshape(-1)[offset:], kind, n_out, k_in, (rpb, wb, wr, wg))
        return m

    def _setup(self, raw, kind, n_out, k_in, layout):
        self.kind, self.block = kind, BLOCKS[kind]
        self.n_out, self.k_in = n_out, k_in
        self.raw = raw  # kept alive: the kernel reads its memory
        self._layout = None if layout is None else np.array(layout, dtype=np.int64)
        self._layout_ptr = 0 if self._layout is None else self._layout.ctypes.data
        self._call = qmatmul.module_function("blockmatmul")
        self._w = (raw.ctypes.data, self.block.ggml_type, self.n_out)

    @property
    def layout(self) -> np.ndarray | None:
        """The kernel's row layout (4 int64: rows per block, then the byte strides of a block, a row
        and a block of weights; see cpu/gguf_blocks.h), or None for a plain matrix."""
        return self._layout

    def __call__(
        self, x: np.ndarray, threads: int = 1, out: np.ndarray | None = None, arith: Arith = Arith.EXACT
    ) -> np.ndarray:
        """x [T, K] float32 (C-contiguous) -> [T, N] float32 (into `out` when given), as StoredMatrix."""
        if x.ndim != 2 or x.shape[1] != self.k_in:
            raise ValueError(f"x must be [T, {self.k_in}] (got shape {x.shape})")
        if out is None:
            out = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        elif out.shape != (x.shape[0], self.n_out):
            raise ValueError(f"out must be [{x.shape[0]}, {self.n_out}] (got shape {out.shape})")
        self.into(x, x.shape[0], out, threads, arith)
        return out

    def into(self, x, rows: int, out, threads: int = 1, arith: Arith = Arith.EXACT) -> None:
        """The product of `rows` input rows into `out` (buffers [rows, K] and [rows, N] float32,
        C-contiguous; the kernel checks their type and size), in `arith`."""
        w, kind = self._w[0], self._w[1]
        self._call(x, rows, self.k_in, w, kind, self.n_out, out, max(threads, 1), self._layout_ptr, 0, 0, int(arith))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Some rows as float32 (embedding lookups: a few rows, never a whole matrix); plain
        matrices only."""
        if self._layout is not None and self._layout[1] != 0:
            raise ValueError("rows() reads plain matrices (rows one after another), not laid-out ones")
        return dequantize(self.raw[np.asarray(ids)], self.kind)


def _block(kind: str) -> GgufBlock:
    if kind not in BLOCKS:
        raise ValueError(f"block type {kind!r} is not one of {', '.join(BLOCKS)}")
    return BLOCKS[kind]
