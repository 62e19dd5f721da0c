"""The quantization of a stored linear, shared by the store format (which records it) and the
backends (which compute with it). Plain python: neither side imports the other for it.

Two kinds: affine groups (MLX's convention, `kind` None: w = q * scale + bias, the codes, scales and
biases stored as three arrays) and GGUF block types kept as the file has them (`kind` the type's
name: one uint8 array of whole blocks per row, scales packed inside; bits 0, group_size the
weights per block; layouts in kernels/cpu/gguf_blocks.h)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GgufBlock:
    name: str
    ggml_type: int  # the GGML type number (ggml.h)
    weights: int  # per block
    nbytes: int  # per block

    def row_bytes(self, cols: int) -> int:
        return cols // self.weights * self.nbytes


BLOCKS = {
    b.name: b
    for b in (
        GgufBlock("Q5_0", 6, 32, 22),
        GgufBlock("Q5_1", 7, 32, 24),
        GgufBlock("Q4_K", 12, 256, 144),
        GgufBlock("Q5_K", 13, 256, 176),
        GgufBlock("Q6_K", 14, 256, 210),
    )
}


@dataclass
class QuantSpec:
    """Affine group quantization (kind None), or a GGUF block type (see the module docstring)."""

    bits: int
    group_size: int
    kind: str | None = None

    def __post_init__(self):
        if self.kind is not None:
            if self.kind not in BLOCKS:
                raise ValueError(f"quantization kind {self.kind!r} is not one of {', '.join(BLOCKS)}")
            if self.bits != 0 or self.group_size != BLOCKS[self.kind].weights:
                raise ValueError(f"a {self.kind} quantization has bits 0 and group_size {BLOCKS[self.kind].weights}")

    @classmethod
    def block(cls, kind: str) -> "QuantSpec":
        return cls(bits=0, group_size=BLOCKS[kind].weights, kind=kind)

    @property
    def is_block(self) -> bool:
        return self.kind is not None
