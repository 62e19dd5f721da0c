"""Attention where the KV lies, as methods of MLXOps: over compressed blocks (the KV tiers' codes on
flash, backends/coded_blocks.py) and over a pool of chunks named by a slot table (the service's
contexts, backends/slot_attention.py), float or of mixed widths, through the CPU attention kernel's
primitives."""

from __future__ import annotations

import mlx.core as mx

from ..kernels import mlx_kernels
from . import slot_attention
from .coded_blocks import block_layouts


def sdpa_coded(self, q, k, v, scale: float, codes, fmt, coded: int):
    k_layout, v_layout, table = block_layouts(fmt, codes.shape[0])
    S, T = coded + k.shape[2], q.shape[2]
    return mlx_kernels.attention_coded(
        q, k, v, scale, self.kernel_threads, codes, k_layout, codes, v_layout,
        mx.array([[coded], [coded]], dtype=mx.int32), mx.array([S], dtype=mx.int32),
        mx.array([S - T], dtype=mx.int32), mx.array(table),
    )  # fmt: skip


def sdpa_slots(self, q, k, v, scale: float, block_tokens: int, table, kv_len, q_pos):
    if self.on_gpu:
        return slot_attention.gathered_sdpa(self, q, k, v, scale, block_tokens, table, kv_len, q_pos)
    shape, axes = slot_attention.block_shape(k.shape, block_tokens)
    return mlx_kernels.attention(
        q, k.reshape(shape).transpose(axes), v.reshape(shape).transpose(axes), scale, self.kernel_threads,
        mx.array(kv_len, dtype=mx.int32), mx.array(q_pos, dtype=mx.int32), mx.array(table, dtype=mx.int32),
    )  # fmt: skip


def sdpa_mixed(self, q, k, v, scale: float, block_tokens: int, table, classes, codes, layouts, kv_len, q_pos):
    shape, axes = slot_attention.block_shape(k.shape, block_tokens)
    return mlx_kernels.attention_mixed(
        q, k.reshape(shape).transpose(axes), v.reshape(shape).transpose(axes), scale, self.kernel_threads, codes,
        layouts, mx.array(kv_len, dtype=mx.int32), mx.array(q_pos, dtype=mx.int32), mx.array(table, dtype=mx.int32),
        mx.array(classes, dtype=mx.int32),
    )  # fmt: skip
