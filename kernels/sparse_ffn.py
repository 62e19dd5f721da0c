"""The sparse FFN kernels' protocol, and its CPU member.

One algorithm, three targets (CPU here; Metal: metal_sparse.py; CUDA: cuda_sparse.py), each equal to
the plain-ops reference sparse_ffn_ref.py and tested against it. A kernel object is built once per
slab layout (a SlabSpec) and answers two calls over a slab of bundle rows (a neuron cache's rows, or
a layer read whole), for the active bundles' slot ids idx[0:count]:

  gate_up(x, slab, idx, count) -> h   x [T, D] -> h [T, S*block]: h[t, j*block + r] = silu(x·gate_r) * (x·up_r)
                                       of bundle idx[j] for j < count, 0 past count
  down(h, slab, idx, count) -> y      y [T, D] = sum over j < count of down(idx[j]) · h[t, j*block:(j+1)*block]

S is the slab's slot count: the device kernels launch for that bound and read `count` from a
device buffer, so no host sync learns it. The CPU member knows count on the host (its caller does)
and computes only what it lists.
"""

from __future__ import annotations

import numpy as np

from .qmatmul import Arith, StoredMatrix
from .slab_spec import SCALE_BYTES, DownLayout, ScaleType, SlabSpec

_SCALE_NP = {ScaleType.F16: np.float16, ScaleType.BF16: np.uint16, ScaleType.F32: np.float32}


def slab_matrices(slab: np.ndarray, spec: SlabSpec) -> tuple[StoredMatrix, StoredMatrix, StoredMatrix]:
    """The CPU kernel's views of a slab's gate, up and down matrices, read where they lie: gate and up
    as rows in blocks (block b = slot b), down as a matrix whose groups are the slots (block layout)
    or as input rows one per slot (column layout). No byte is copied."""
    S, rb = slab.shape
    if rb != spec.row_bytes or not slab.flags.c_contiguous or slab.dtype != np.uint8:
        raise ValueError(
            f"slab must be a C-contiguous uint8 [slots, {spec.row_bytes}] array (got {slab.dtype} {slab.shape})"
        )
    D, B, st = spec.d_model, spec.block, spec.scale_type
    sdt, ss = _SCALE_NP[st], SCALE_BYTES[st]
    bf16 = st is ScaleType.BF16

    def rows(name):
        m = getattr(spec, name)
        groups, wpg = D // m.group, m.group * m.bits // 32
        w = np.ndarray((S, B, groups, wpg), np.uint32, slab, m.w, (rb, groups * wpg * 4, wpg * 4, 4))
        s, b = (np.ndarray((S, B, groups), sdt, slab, off, (rb, groups * ss, ss)) for off in (m.s, m.b))
        return StoredMatrix(w, s, b, m.bits, m.group, True, bf16)

    m = spec.down
    if spec.down_layout is DownLayout.BLOCK:  # row d, group j: slot j's slice of row d
        wpg = B * m.bits // 32
        w = np.ndarray((1, D, S, wpg), np.uint32, slab, m.w, (0, wpg * 4, rb, 4))
        s, b = (np.ndarray((1, D, S), sdt, slab, off, (0, ss, rb)) for off in (m.s, m.b))
        down = StoredMatrix(w, s, b, m.bits, m.group, True, bf16)
    else:  # input row j = slot j's down column, quantized along D
        w = np.ndarray((S, D * m.bits // 32), np.uint32, slab, m.w, (rb, 4))
        s, b = (np.ndarray((S, D // m.group), sdt, slab, off, (rb, ss)) for off in (m.s, m.b))
        down = StoredMatrix(w, s, b, m.bits, m.group, False, bf16)
    return rows("gate"), rows("up"), down


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u, written into g (float32)."""
    with np.errstate(over="ignore"):  # exp(-g) -> inf for g << 0: g / inf is the right 0
        e = np.exp(-g)
    e += 1.0
    np.divide(g, e, out=g)
    g *= u
    return g


class CpuSparseFFN:
    """The CPU member: the fused quantized matmul (cpu/qmatmul*.cpp) given the active bundles' slot
    ids, reading gate and up rows of those slots and the down groups (or columns) of those slots
    where they lie in the slab. count is a host int; nothing past it is read."""

    name = "cpu"

    def __init__(self, spec: SlabSpec, threads: int = 1, arith: Arith = Arith.EXACT):
        self.spec, self.threads, self.arith = spec, threads, arith
        self._views = {}  # (address, shape, strides, dtype) -> the slab and its three matrices

    def matrices(self, slab: np.ndarray) -> tuple[StoredMatrix, StoredMatrix, StoredMatrix]:
        """The kernel's (gate, up, down) views of `slab` (built once per slab)."""
        return self._matrices(slab)

    def _matrices(self, slab: np.ndarray):
        key = (slab.ctypes.data, slab.shape, slab.strides, slab.dtype.str)
        if key not in self._views:
            if len(self._views) > 64:  # slabs come and go (whole layers read into transient buffers)
                self._views.clear()
            self._views[key] = (slab, slab_matrices(slab, self.spec))  # the slab kept alive with its views
        return self._views[key][1]

    def products(self, x: np.ndarray, slab: np.ndarray, idx: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """x [T, D] float32 -> (x·gate, x·up) [T, count*block] each, before the activation: the backends
        apply their own silu, so a step equals the resident model's to the bit."""
        gate, up, _ = self._matrices(slab)
        ids = np.ascontiguousarray(idx[:count], dtype=np.int32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        return gate.sparse(x, ids, self.threads, arith=self.arith), up.sparse(x, ids, self.threads, arith=self.arith)

    def gate_up(self, x: np.ndarray, slab: np.ndarray, idx: np.ndarray, count: int) -> np.ndarray:
        """x [T, D] float32 -> h [T, count*block] (only the active bundles: the CPU knows count)."""
        return silu_mul(*self.products(x, slab, idx, count))

    def down(self, h: np.ndarray, slab: np.ndarray, idx: np.ndarray, count: int) -> np.ndarray:
        """h [T, >= count*block] float32 -> y [T, D]."""
        _, _, down = self._matrices(slab)
        ids = np.ascontiguousarray(idx[:count], dtype=np.int32)
        h = np.ascontiguousarray(h[:, : count * self.spec.block], dtype=np.float32)
        return down.sparse(h, ids, self.threads, arith=self.arith)
