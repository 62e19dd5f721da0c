"""Blocks of a sequence's older keys and values at 8, 4 or 2 bits: how the KV tiers keep them on flash
when compressed (models/kv_tiers.py, `kv_flash_bits`) and how attention reads them where they lie
(kernels/cpu/attention.cpp mf_attention_coded, through the layout backends/coded_blocks.py derives
from `views`), never as a float copy of the context.

A block is `tokens` (the tiers' eviction step) consecutive tokens of one layer, every KV head, in one
run of bytes, so a layer's tokens [0, n) are one contiguous range of the file and of a read buffer:

    key codes     [heads, head_dim, tokens * bits / 8]   per channel over the block's tokens (keys'
    key scales    [heads, head_dim] float16              outliers sit in fixed channels: KIVI)
    key biases    [heads, head_dim] float16
    value codes   [heads, tokens, head_dim * bits / 8]   per token, groups of VALUE_GROUP channels
    value scales  [heads, tokens, head_dim / VALUE_GROUP] float16
    value biases  the same

The quantization is models/kv_quant.py's (the service's compressed chunks group keys and values the
same way), so what attention computes equals the float kernel over `decode`'s values bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kv_quant import dequantize, quantize

WIDTHS = (8, 4, 2)
VALUE_GROUP = 32  # channels one value scale covers (all of them in a smaller head)


@dataclass(frozen=True)
class BlockFormat:
    """One layer's block of `tokens` tokens at `bits` (see the module docstring)."""

    bits: int
    kv_heads: int
    head_dim: int
    tokens: int

    def __post_init__(self):
        if self.bits not in WIDTHS:
            raise ValueError(f"KV on flash at {self.bits} bits: 8, 4 or 2 are kept")
        if self.head_dim % self.group or (self.tokens * self.bits) % 8:
            raise ValueError(f"head dim {self.head_dim} or {self.tokens}-token blocks do not split at {self.bits} bits")

    @property
    def group(self) -> int:
        """Channels one value scale covers."""
        return min(VALUE_GROUP, self.head_dim)

    @property
    def _sizes(self) -> tuple[int, int, int, int]:
        """Bytes of the key codes, of the key scales (or biases), the value codes, the value scales."""
        H, D, T, b = self.kv_heads, self.head_dim, self.tokens, self.bits
        return H * D * T * b // 8, H * D * 2, H * T * D * b // 8, H * T * D // self.group * 2

    @property
    def nbytes(self) -> int:
        kc, ks, vc, vs = self._sizes
        return kc + 2 * ks + vc + 2 * vs

    def bytes_per_token(self) -> float:
        return self.nbytes / self.tokens

    def views(self, buf: np.ndarray) -> tuple[np.ndarray, ...]:
        """The six parts of every block of `buf` (uint8 [blocks, nbytes]), as quantize lays them out:
        key codes [blocks, H, D, T*b/8], key scales and biases [blocks, H, D, 1], value codes
        [blocks, H, T, D*b/8], value scales and biases [blocks, H, T, D/G]."""
        if buf.dtype != np.uint8 or buf.ndim != 2 or buf.shape[1] != self.nbytes:
            raise ValueError(f"KV blocks: uint8 [blocks, {self.nbytes}] expected, not {buf.dtype} {buf.shape}")
        H, D, T, b = self.kv_heads, self.head_dim, self.tokens, self.bits
        kc, ks, vc, vs = self._sizes
        n, at, views = buf.shape[0], 0, []
        for size, dtype, shape in (
            (kc, np.uint8, (H, D, T * b // 8)),
            (ks, np.float16, (H, D, 1)),
            (ks, np.float16, (H, D, 1)),
            (vc, np.uint8, (H, T, D * b // 8)),
            (vs, np.float16, (H, T, D // self.group)),
            (vs, np.float16, (H, T, D // self.group)),
        ):
            views.append(buf[:, at : at + size].view(dtype).reshape(n, *shape))  # splits one axis: a view
            at += size
        return tuple(views)

    def encode(self, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Keys and values float32 [heads, blocks * tokens, head_dim] -> uint8 [blocks, nbytes]."""
        H, n, D = k.shape
        T = self.tokens
        if n % T or (H, D) != (self.kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(f"KV blocks of {T} tokens: {k.shape} and {v.shape} do not split into them")
        out = np.empty((n // T, self.nbytes), np.uint8)
        kc, ks, kb, vc, vs, vb = self.views(out)
        by_block = k.reshape(H, n // T, T, D).transpose(1, 0, 3, 2)  # [blocks, H, D, T]
        kc[...], ks[...], kb[...] = quantize(np.ascontiguousarray(by_block, np.float32), self.bits, T)
        vc[...], vs[...], vb[...] = quantize(v.reshape(H, n // T, T, D).transpose(1, 0, 2, 3), self.bits, self.group)
        return out

    def decode(self, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The inverse of encode: uint8 [blocks, nbytes] -> keys and values float32 [heads, blocks *
        tokens, head_dim], the values attention computes with."""
        kc, ks, kb, vc, vs, vb = self.views(buf)
        n, H, T, D = buf.shape[0], self.kv_heads, self.tokens, self.head_dim
        keys = dequantize(kc, ks, kb, self.bits, T)  # [blocks, H, D, T]
        values = dequantize(vc, vs, vb, self.bits, self.group)  # [blocks, H, T, D]
        return (
            np.ascontiguousarray(keys.transpose(1, 0, 3, 2)).reshape(H, n * T, D),
            np.ascontiguousarray(values.transpose(1, 0, 2, 3)).reshape(H, n * T, D),
        )
