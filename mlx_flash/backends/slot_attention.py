"""Attention over keys and values where a pool of fixed-size chunks keeps them, the chunks of each row
named by a slot table (the service's chunked contexts, service/chunk_pool.py): what ops.sdpa_slots
computes. On a CPU both backends run the attention kernel over the pool where it lies
(kernels/cpu/attention.cpp, its slot-table mode), so a step gathers no copy of any row's keys;
`gathered_sdpa` states the same in plain ops (each row's keys gathered in order, right-padded to the
longest, masked), which a device without that kernel runs and the tests hold the kernel to.

A pool layer is [Hkv, slots * C, hd] (slot s holds tokens [s*C, (s+1)*C) along axis 1); the kernel
reads it as [slots, Hkv, C, hd], a strided view of the same memory (`block_shape`). Row b holds kv_len[b]
keys, its chunks table[b, :] in order, and its first query sits at position q_pos[b]: query t sees
key j when j <= q_pos[b] + t and j < kv_len[b].
"""

from __future__ import annotations

import numpy as np


def block_shape(pool_shape, block_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the shape to reshape a pool layer [Hkv, slots * C, hd] to, the axes that make it [slots, Hkv,
    C, hd]): both views, no copy."""
    H, N, hd = pool_shape
    if N % block_tokens:
        raise ValueError(f"a pool of {N} tokens is not whole chunks of {block_tokens}")
    return (H, N // block_tokens, block_tokens, hd), (1, 0, 2, 3)


def table_rows(table: np.ndarray, block_tokens: int, S: int) -> np.ndarray:
    """Pool rows (along axis 1) of each row's first S keys: int64 [B, S]."""
    rows = table.astype(np.int64)[:, :, None] * block_tokens + np.arange(block_tokens)
    return rows.reshape(table.shape[0], -1)[:, :S]


def seen(kv_len: np.ndarray, q_pos: np.ndarray, T: int, S: int) -> np.ndarray:
    """bool [B, 1, T, S]: what each query sees (at least key 0: a query that sees no key, none of
    the service's steps has one, gets key 0 instead of a softmax over nothing)."""
    j = np.arange(S)[None, None, :]
    last = q_pos.astype(np.int64)[:, None] + np.arange(T)[None, :]  # [B, T]
    keep = (j <= last[:, :, None]) & (j < kv_len.astype(np.int64)[:, None, None])
    keep[:, :, 0] |= ~keep.any(axis=2)
    return keep[:, None]


def gathered_rows(ops, pool, idx, B: int, S: int):
    """Pool rows idx (a backend index of B rows of S tokens each, row-major) of a pool layer [Hkv, N,
    hd] as [B, Hkv, S, hd]: one gather."""
    g = ops.reshape(ops.take_tokens(pool, idx), (pool.shape[0], B, S, pool.shape[2]))
    return ops.transpose(g, (1, 0, 2, 3))


def gathered_sdpa(ops, q, k, v, scale: float, block_tokens: int, table, kv_len, q_pos):
    """ops.sdpa_slots in plain ops: every row's keys and values gathered through its slots into
    [B, Hkv, S, hd] (S its longest row), then sdpa under the mask of what each query sees."""
    B, T = table.shape[0], q.shape[2]
    S = int(np.max(kv_len))
    idx = ops.index(table_rows(table, block_tokens, S).reshape(-1))
    keys, values = gathered_rows(ops, k, idx, B, S), gathered_rows(ops, v, idx, B, S)
    return ops.sdpa(q, keys, values, scale, ops.mask(seen(kv_len, q_pos, T, S)))
