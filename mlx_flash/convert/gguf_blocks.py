"""GGUF block quantizations as MLX affine triples, in numpy (no framework arrays, no file access).

A GGUF Q4_0 / Q4_1 / Q8_0 tensor is a sequence of blocks of 32 weights along its rows, each block a
float16 scale d (and for Q4_1 a float16 minimum m) followed by the codes. The store keeps such a
tensor as the affine triple MLX uses (`w = code * scale + bias`, codes packed little-endian into
uint32 words, element i of a word at bits bits*i), which holds the same values exactly:
  Q4_0: code = nibble,          scale = d, bias = -8 d
  Q4_1: code = nibble,          scale = d, bias = m
  Q8_0: code = int8 + 128,      scale = d, bias = -128 d
(-8 d and -128 d are exact in float16: a power-of-two multiple.) These are the triples `mx.load`
returns for the same file, bit for bit (tests/convert/test_gguf_source.py), computed here block by
block so a tensor can be read by offset without loading the file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockType:
    name: str
    block_bytes: int  # bytes per block of `GROUP` weights
    bits: int
    has_min: bool  # a float16 minimum follows the scale (Q4_1)


GROUP = 32
# GGML type numbers (ggml.h) of the block types kept as affine triples.
BLOCK_TYPES = {
    2: BlockType("Q4_0", 18, 4, False),
    3: BlockType("Q4_1", 20, 4, True),
    8: BlockType("Q8_0", 34, 8, False),
}
# GGML type numbers of plain element types -> (numpy dtype holding them, storage dtype name).
PLAIN_TYPES = {0: (np.float32, "float32"), 1: (np.float16, "float16"), 30: (np.uint16, "bfloat16")}


class BlockValueError(ValueError):
    """A block whose values cannot be kept as stored (the caller names the tensor and file)."""


def affine_shapes(bt: BlockType, rows_shape: tuple[int, ...], cols: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the triple for a tensor of `rows_shape` rows of `cols` weights."""
    return {
        "weight": (*rows_shape, cols * bt.bits // 32),
        "scales": (*rows_shape, cols // GROUP),
        "biases": (*rows_shape, cols // GROUP),
    }


def decode_blocks(bt: BlockType, raw: np.ndarray, cols: int) -> dict[str, np.ndarray]:
    """raw: uint8 [..., cols / 32 * block_bytes] (a tensor's rows as stored) -> {"weight": uint32 codes,
    "scales": float16, "biases": float16} with the leading shape of `raw`."""
    lead = raw.shape[:-1]
    blocks = raw.reshape(*lead, cols // GROUP, bt.block_bytes)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    if bt.has_min:
        bias = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    else:
        offset = 8 if bt.bits == 4 else 128
        with np.errstate(over="ignore"):
            bias = (d.astype(np.float32) * -offset).astype(np.float16)
        # -offset x d is the block's bias, kept as float16 beside d: a scale past 65504 / offset has
        # none (only a corrupt block holds one; real weights' scales are far smaller)
        bad = np.isfinite(d) & ~np.isfinite(bias)
        if bad.any():
            raise BlockValueError(
                f"a {bt.name} block scale of {float(d[bad].flat[0]):g} puts its bias "
                f"({-offset} x scale) past float16's range: a corrupt block"
            )
    qs = blocks[..., 4:] if bt.has_min else blocks[..., 2:]
    if bt.bits == 4:
        # GGUF: byte j holds weight j (low nibble) and weight j + 16 (high nibble).
        # MLX: byte j holds weight 2j (low nibble) and weight 2j + 1 (high nibble).
        w = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        packed = (w[..., 0::2] | (w[..., 1::2] << 4)).astype(np.uint8)
    else:
        packed = qs ^ np.uint8(0x80)  # int8 two's complement + 128 as uint8
    codes = np.ascontiguousarray(packed).reshape(*lead, -1).view(np.uint32)
    return {"weight": codes, "scales": np.ascontiguousarray(d), "biases": np.ascontiguousarray(bias)}
