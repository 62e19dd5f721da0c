"""Where a sparse FFN's weights lie in a slab of bundle rows: the one description the sparse FFN
kernels (CPU, Metal, CUDA) and their plain-ops reference read (sparse_ffn_ref.py).

A slab is a uint8 matrix [slots, row_bytes]: each row one bundle exactly as the store holds it (a
neuron cache's rows, or a whole layer read from flash). A bundle holds `block` neurons:

  gate, up   [block, D*bits/32] uint32 words, row r = neuron r of the bundle, quantized along D in
             groups of `group`; scales and biases [block, D/group]
  down       DownLayout.BLOCK  (block > 1, the source's own down groups): [D, block*bits/32] words,
             row d = the bundle's `block` weights of output d, one group (group == block); scales
             and biases [D]
             DownLayout.COLUMN (block == 1, per-neuron bundles): the neuron's down column [D*bits/32]
             words, quantized along D in groups of `group`; scales and biases [D/group]

Codes are affine (w = q * scale + bias), packed little-endian into uint32 words (code j of a row at
bit bits*(j % (32/bits)) of word j // (32/bits)); scales and biases are float16, bfloat16 (as uint16
words) or float32, one type per slab. Framework-neutral: plain ints, no arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class ScaleType(IntEnum):
    F16 = 0
    BF16 = 1
    F32 = 2


class DownLayout(IntEnum):
    BLOCK = 0
    COLUMN = 1


SCALE_BYTES = {ScaleType.F16: 2, ScaleType.BF16: 2, ScaleType.F32: 4}
SCALE_TYPES = {"float16": ScaleType.F16, "bfloat16": ScaleType.BF16, "float32": ScaleType.F32}
SPARSE_BITS = (4, 8)  # widths the sparse kernels read


@dataclass(frozen=True)
class Matrix:
    """One of gate, up, down inside a bundle: byte offsets of its words, scales and biases."""

    w: int
    s: int
    b: int
    bits: int
    group: int


@dataclass(frozen=True)
class SlabSpec:
    d_model: int
    block: int
    row_bytes: int
    gate: Matrix
    up: Matrix
    down: Matrix
    down_layout: DownLayout
    scale_type: ScaleType

    def __post_init__(self):
        for name in ("gate", "up", "down"):
            m: Matrix = getattr(self, name)
            if m.bits not in SPARSE_BITS:
                raise ValueError(f"{name}: the sparse FFN kernels read {SPARSE_BITS}-bit codes (got {m.bits})")
            if m.group <= 0 or m.group % 32:
                raise ValueError(f"{name}: group size must be a positive multiple of 32 (got {m.group})")
        if self.d_model % self.gate.group or self.d_model % self.up.group:
            raise ValueError(f"d_model {self.d_model} is not a multiple of the gate/up group sizes")
        if self.down_layout is DownLayout.BLOCK and self.down.group != self.block:
            raise ValueError(
                f"a block down layout needs one group per block (group {self.down.group}, block {self.block})"
            )
        if self.down_layout is DownLayout.COLUMN and (self.block != 1 or self.d_model % self.down.group):
            raise ValueError("a column down layout needs bundles of one neuron and d_model a multiple of its group")

    # ---- sizes of each part of a bundle, in bytes ----
    def words_bytes(self, name: str) -> int:
        m: Matrix = getattr(self, name)
        if name == "down" and self.down_layout is DownLayout.BLOCK:
            return self.d_model * self.block * m.bits // 8
        return self.block * self.d_model * m.bits // 8

    def scales_count(self, name: str) -> int:
        m: Matrix = getattr(self, name)
        if name == "down" and self.down_layout is DownLayout.BLOCK:
            return self.d_model
        return self.block * self.d_model // m.group

    def bytes_per_bundle(self, names=("gate", "up", "down")) -> int:
        """Bytes a kernel must read per active bundle (words, scales and biases of these matrices)."""
        sb = SCALE_BYTES[self.scale_type]
        return sum(self.words_bytes(n) + 2 * sb * self.scales_count(n) for n in names)


def spec_of(layout) -> SlabSpec | None:
    """The SlabSpec of a store's FFN layout (an mlx_flash.store.manifest.FFNLayout), or None where the
    sparse kernels do not apply: float rows, widths other than 4/8, ungated FFNs, per-neuron biases,
    experts, whole-expert down matrices, mixed scale types."""
    if not layout.gated or layout.n_experts or layout.down_rows:
        return None
    f = {x.name: x for x in layout.fields}
    if any(n.endswith(".bias") for n in f):
        return None
    mats, types = {}, set()
    for role in ("gate", "up", "down"):
        q = layout.quant.get(role)
        if q is None or q.bits not in SPARSE_BITS or q.group_size % 32:
            return None
        s = f[f"{role}.scales"]
        if s.dtype not in SCALE_TYPES or f[f"{role}.biases"].dtype != s.dtype:
            return None
        types.add(SCALE_TYPES[s.dtype])
        mats[role] = Matrix(f[f"{role}.weight"].offset, s.offset, f[f"{role}.biases"].offset, q.bits, q.group_size)
    if len(types) != 1:
        return None
    down = DownLayout.BLOCK if layout.block > 1 else DownLayout.COLUMN
    try:
        return SlabSpec(
            layout.d_model, layout.block, layout.bundle_bytes, mats["gate"], mats["up"], mats["down"], down, types.pop()
        )
    except ValueError:
        return None
