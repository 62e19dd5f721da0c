"""The throughput mode's per-sequence KV caches: exact (`KVCache`), or group-wise 4-bit (FlexGen §5,
an approximation chosen by policy.kv_bits), which holds a quarter of float16's bytes plus a float16
scale and bias per group and so fits ~6x more sequences' KV in the same memory.

`QuantizedKV` keeps codes, not floats: each update quantizes the new keys and values (affine,
min..max, groups of KV_GROUP along the head dimension, the service's quantizer in
service/compression.py) into preallocated numpy buffers and hands the graph the held tokens
dequantized, a temporary of one layer that lives while that layer computes.
"""

from __future__ import annotations

import numpy as np

from ..memory.process_plan import ModelShape
from ..models.cache import KVCache, LayerKV
from ..service.compression import dequantize, quantize
from .policy import KV_GROUP


class QuantizedKV(LayerKV):
    holds = "the batch's KV cache holds"

    def __init__(self, max_tokens: int, heads: int, head_dim: int, bits: int = 4):
        self.bits, self.capacity, self.offset = bits, max_tokens, 0
        self.group = min(KV_GROUP, head_dim)
        per = 8 // bits
        g = head_dim // self.group
        # [2 (keys, values), Hkv, tokens, ...]: codes, then float16 scale and bias per group
        self.codes = np.zeros((2, heads, max_tokens, head_dim // per), np.uint8)
        self.scales = np.zeros((2, heads, max_tokens, g), np.float16)
        self.biases = np.zeros((2, heads, max_tokens, g), np.float16)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.biases.nbytes

    def update(self, ops, k, v):
        B, _, T, _ = k.shape
        if B != 1:
            raise ValueError(f"a quantized KV cache holds one sequence (got a batch of {B})")
        end = self.offset + T
        if end > self.capacity:
            raise ValueError(f"{end} tokens exceed the {self.capacity} this cache was made for")
        for j, x in enumerate((k, v)):
            c, s, b = quantize(np.asarray(ops.to_numpy(x)[0], np.float32), self.bits, self.group)
            self.codes[j, :, self.offset:end], self.scales[j, :, self.offset:end], self.biases[j, :, self.offset:end] = c, s, b
        self.offset = end
        return self._held(ops, 0), self._held(ops, 1)

    def _held(self, ops, j: int):
        n = self.offset
        x = dequantize(self.codes[j, :, :n], self.scales[j, :, :n], self.biases[j, :, :n], self.bits, self.group)
        return ops.array(x[None])

    def trim(self, n: int) -> None:
        self._check_trim(n)
        self.offset -= n

    def state(self, ops):
        n = self.offset
        return tuple(dequantize(self.codes[j, :, :n], self.scales[j, :, :n], self.biases[j, :, :n], self.bits,
                                self.group)[None] for j in (0, 1))


def make_row_caches(engine, kv_bits: int, tokens: int) -> list[LayerKV]:
    """One sequence's per-layer caches for `tokens` tokens: exact, or at kv_bits."""
    shape = ModelShape.from_config(engine.store.config)
    if not kv_bits:
        return [KVCache(tokens) for _ in range(shape.layers)]
    return [QuantizedKV(tokens, shape.kv_heads, shape.head_dim, kv_bits) for _ in range(shape.layers)]
