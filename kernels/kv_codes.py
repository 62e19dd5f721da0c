"""Compressed KV as the attention kernel reads it (kernels/cpu/kv_codes.h): where each code, scale
and bias of a layer's keys or values lies, so attention dequantizes a block of keys as it gathers it
instead of being handed a float copy of the context (mf_attention_coded in cpu/attention.cpp).

Codes are affine (models/kv_quant.py: x ~ code * scale + bias, float16 scale and bias per group,
value i of a byte at bits * i). A layout names a 4-D index (block or row, head, token, channel) for
the codes and (block or row, head, token group, channel group) for the scales and biases, so both
groupings the engine uses fit: keys per channel over a block of tokens (KIVI: group_tokens > 1,
group_channels 1) and values per token in groups of channels. `from_views` reads the strides off
numpy views of the arrays that hold them; `dequantize` is the plain-ops reading the kernel must equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .stored_operands import one_buffer

INTS = 15  # MF_KV_CODES_INTS
BITS = (8, 4, 2)
RAW = 32  # a layout of raw float32 (strides count floats, no scales): a chunk kept exact beside codes


@dataclass(frozen=True)
class CodedLayout:
    """kv_codes.h's mf_kv_codes, less the buffer: offsets in bytes, strides in codes and float16 values."""

    bits: int
    codes: int
    scales: int
    biases: int
    code_strides: tuple[int, int, int, int]  # block (or row), head, token, channel
    scale_strides: tuple[int, int, int, int]  # block (or row), head, token group, channel group
    group_tokens: int
    group_channels: int
    block_tokens: int = 0  # tokens of a block when a slot table names blocks

    def ints(self) -> list[int]:
        """The layout as the operators take it (kv_codes.h's order)."""
        return [
            self.bits,
            self.codes,
            self.scales,
            self.biases,
            *self.code_strides,
            *self.scale_strides,
            self.group_tokens,
            self.group_channels,
            self.block_tokens,
        ]

    def dequantize(self, buffer: np.ndarray, blocks: int, heads: int, tokens: int, hd: int) -> np.ndarray:
        """float32 [blocks, heads, tokens, hd]: every element the layout describes, by plain indexing
        (the reference the kernel's gathering must equal bit for bit)."""
        b, h, t, d = np.meshgrid(*(np.arange(n) for n in (blocks, heads, tokens, hd)), indexing="ij")
        cs, ss = self.code_strides, self.scale_strides
        if self.bits == RAW:
            at = self.codes + 4 * (b * cs[0] + h * cs[1] + t * cs[2] + d * cs[3])
            return buffer.view(np.uint8)[at[..., None] + np.arange(4)].view(np.float32)[..., 0]
        bit = (b * cs[0] + h * cs[1] + t * cs[2] + d * cs[3]) * self.bits
        codes = (buffer[self.codes + (bit >> 3)] >> (bit & 7).astype(np.uint8)) & ((1 << self.bits) - 1)
        si = b * ss[0] + h * ss[1] + (t // self.group_tokens) * ss[2] + (d // self.group_channels) * ss[3]
        half = buffer.view(np.uint8)

        def f16_at(offset):
            return np.frombuffer(half, np.float16, count=(half.size - offset) // 2, offset=offset)[si]

        return codes.astype(np.float32) * f16_at(self.scales).astype(np.float32) + f16_at(self.biases).astype(
            np.float32
        )


def from_views(
    codes: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    packed: str,
    group_tokens: int,
    group_channels: int,
    block_tokens: int = 0,
) -> tuple[np.ndarray, CodedLayout]:
    """(buffer, layout) from numpy views: codes uint8 [blocks, heads, tokens, channels] with the axis
    named by `packed` ("tokens" or "channels") holding 8 / bits codes a byte, scales and biases
    float16 [blocks, heads, token groups, channel groups]. The buffer is the views' own memory when
    they share one owner (no copy), else a copy of each (one_buffer)."""
    if bits not in BITS:
        raise ValueError(f"KV codes of {bits} bits: 8, 4 or 2 are read")
    if packed not in ("tokens", "channels"):
        raise ValueError(f"packed axis {packed!r}: 'tokens' or 'channels'")
    if codes.dtype != np.uint8 or scales.dtype != np.float16 or biases.dtype != np.float16:
        raise ValueError("codes must be uint8, scales and biases float16")
    if codes.ndim != 4 or scales.ndim != 4 or scales.shape != biases.shape or scales.strides != biases.strides:
        raise ValueError("codes, scales and biases must be 4-D, scales and biases alike")
    axis = 2 if packed == "tokens" else 3
    if codes.strides[axis] != 1:
        raise ValueError(f"the packed axis ({packed}) must be contiguous bytes")
    per = 8 // bits
    code_strides = tuple(1 if i == axis else s * per for i, s in enumerate(codes.strides))
    if any(s % 2 for s in scales.strides):
        raise ValueError("scales must be float16 views")
    buffer, (c, s, b), _ = one_buffer([codes, scales, biases])
    layout = CodedLayout(
        bits, c, s, b, code_strides, tuple(st // 2 for st in scales.strides), group_tokens, group_channels, block_tokens
    )
    return buffer, layout


def raw_layout(offset: int, strides: tuple[int, int, int, int], block_tokens: int = 0) -> CodedLayout:
    """Float32 values at byte `offset` of a buffer with (block, head, token, channel) strides in floats."""
    return CodedLayout(RAW, offset, 0, 0, strides, (0, 0, 0, 0), 1, 1, block_tokens)


@lru_cache(maxsize=None)
def pairs_ints(layouts: tuple) -> list[int]:
    """A tuple of (keys', values') layout pairs as the mixed-width attention operators take them: each
    pair's ints, keys' first (built once per tuple: they are asked every layer and step)."""
    return [i for pair in layouts for layout in pair for i in layout.ints()]
