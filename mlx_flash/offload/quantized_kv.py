"""The throughput mode's per-sequence KV caches: exact (`KVCache`), or group-wise 4-bit (FlexGen §5,
an approximation chosen by policy.kv_bits), which holds a quarter of float16's bytes plus a float16
scale and bias per group and so fits ~6x more sequences' KV in the same memory.

`QuantizedKV` keeps codes, not floats: each update quantizes the new keys and values (affine,
min..max, models/kv_quant.py, as the service's chunks) into preallocated numpy buffers and
hands the graph the held tokens dequantized, a temporary of one layer that lives while that layer
computes.
"""

from __future__ import annotations

import numpy as np

from ..memory.process_plan import ModelShape
from ..models.cache import KVCache, LayerKV
from ..models.kv_quant import dequantize, quantize
from .policy import KEY_BLOCK, KV_GROUP


class QuantizedKV(LayerKV):
    """One sequence's keys and values of one layer at `bits`, as codes. Keys are quantized per channel
    over blocks of KEY_BLOCK tokens (their outliers sit in fixed channels, so a per-token group would
    spend its range on them), values per token in groups of the head dimension (KIVI's split); the
    keys of the last, incomplete block stay float until it fills."""

    holds = "the batch's KV cache holds"

    def __init__(self, max_tokens: int, heads: int, head_dim: int, bits: int = 4):
        self.bits, self.capacity, self.offset = bits, max_tokens, 0
        self.group = min(KV_GROUP, head_dim)
        per, blocks = 8 // bits, -(-max_tokens // KEY_BLOCK)
        # keys: [Hkv, blocks, hd, KEY_BLOCK / per] codes, a float16 scale and bias per (block, channel)
        self.kcodes = np.zeros((heads, blocks, head_dim, KEY_BLOCK // per), np.uint8)
        self.kscale = np.zeros((heads, blocks, head_dim), np.float16)
        self.kbias = np.zeros((heads, blocks, head_dim), np.float16)
        self.ktail = np.zeros((heads, KEY_BLOCK, head_dim), np.float32)  # the incomplete block, exact
        # values: [Hkv, tokens, hd / per] codes, a float16 scale and bias per (token, group)
        self.vcodes = np.zeros((heads, max_tokens, head_dim // per), np.uint8)
        self.vscale = np.zeros((heads, max_tokens, head_dim // self.group), np.float16)
        self.vbias = np.zeros((heads, max_tokens, head_dim // self.group), np.float16)

    @property
    def nbytes(self) -> int:
        return sum(
            a.nbytes for a in (self.kcodes, self.kscale, self.kbias, self.ktail, self.vcodes, self.vscale, self.vbias)
        )

    def update(self, ops, k, v):
        B, _, T, _ = k.shape
        if B != 1:
            raise ValueError(f"a quantized KV cache holds one sequence (got a batch of {B})")
        end = self.offset + T
        if end > self.capacity:
            raise ValueError(f"{end} tokens exceed the {self.capacity} this cache was made for")
        kn = np.asarray(ops.to_numpy(k)[0], np.float32)  # [H, T, hd]
        vn = np.asarray(ops.to_numpy(v)[0], np.float32)
        c, sc, bi = quantize(vn, self.bits, self.group)
        self.vcodes[:, self.offset : end], self.vscale[:, self.offset : end], self.vbias[:, self.offset : end] = (
            c,
            sc,
            bi,
        )
        for t in range(T):  # keys into the tail; a full tail becomes a quantized block
            pos = self.offset + t
            self.ktail[:, pos % KEY_BLOCK] = kn[:, t]
            if pos % KEY_BLOCK == KEY_BLOCK - 1:
                blk = pos // KEY_BLOCK
                kc, ks, kb = quantize(np.ascontiguousarray(self.ktail.transpose(0, 2, 1)), self.bits, KEY_BLOCK)
                self.kcodes[:, blk], self.kscale[:, blk], self.kbias[:, blk] = kc, ks[..., 0], kb[..., 0]
        self.offset = end
        keys, values = self.state(ops)
        return ops.array(keys), ops.array(values)

    def trim(self, n: int) -> None:
        self._check_trim(n)
        if n and (self.offset - n) // KEY_BLOCK != (self.offset - 1) // KEY_BLOCK:
            raise ValueError("a 4-bit KV cache cannot forget tokens of a block it has quantized")
        self.offset -= n

    def state(self, ops):
        n, full = self.offset, self.offset // KEY_BLOCK
        H, _, hd, _ = self.kcodes.shape
        keys = np.empty((H, n, hd), np.float32)
        if full:
            kq = dequantize(
                self.kcodes[:, :full],
                self.kscale[:, :full, :, None],
                self.kbias[:, :full, :, None],
                self.bits,
                KEY_BLOCK,
            )  # [H, full, hd, KEY_BLOCK]
            keys[:, : full * KEY_BLOCK] = kq.transpose(0, 1, 3, 2).reshape(H, full * KEY_BLOCK, hd)
        keys[:, full * KEY_BLOCK :] = self.ktail[:, : n - full * KEY_BLOCK]
        values = dequantize(self.vcodes[:, :n], self.vscale[:, :n], self.vbias[:, :n], self.bits, self.group)
        return keys[None], values[None]


def make_row_caches(engine, kv_bits: int, tokens: int) -> list[LayerKV]:
    """One sequence's per-layer caches for `tokens` tokens: exact, or at kv_bits."""
    shape = ModelShape.from_config(engine.store.config)
    if not kv_bits:
        return [KVCache(tokens) for _ in range(shape.layers)]
    return [QuantizedKV(tokens, shape.kv_heads, shape.head_dim, kv_bits) for _ in range(shape.layers)]
