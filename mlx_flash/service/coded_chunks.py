"""Compressed chunks held in memory at their width: an arena of the bytes a chunk's swap file holds,
read by attention where they lie (kernels/cpu/attention.cpp mf_attention_mixed).

A compressed chunk is `encode`'s bytes: per layer and head, keys' codes packed along the
chunk's tokens with a float16 scale and bias per channel, then values' codes packed along the head
dimension with a scale and bias per GROUP channels. `chunk_parts` names those six arrays; encode,
decode and the kernel's layouts are all read off it, so the three cannot disagree. In the arena a
chunk starts on a UNIT-byte boundary: the slot table names it by that offset / UNIT, so chunks of
8, 4 and 2 bits share one buffer and one table, each width's layouts taking blocks UNIT bytes apart.

CodedArena hands out those ranges (first fit over a free list, neighbours merged when freed), with a
holder count per chunk as ChunkPool keeps per slot (forked contexts share their full chunks).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..errors import MemoryBudgetError
from ..kernels.kv_codes import RAW, CodedLayout, from_views, raw_layout
from ..models.kv_quant import dequantize, quantize

UNIT = 64  # bytes: a chunk's offset in the arena is a multiple of this
GROUP = 32  # values: channels per scale and bias
WIDTHS = (8, 4, 2)  # what a chunk is compressed to
CLASSES = (*WIDTHS, RAW)  # class c of the kernel's class table reads chunks of CLASSES[c - 1] bits


def packed_bytes(shape, bits: int) -> int:
    """Bytes a chunk of float32 `shape` [layers, 2, Hkv, C, hd] takes at `bits` (codes + float16
    scales and biases; RAW: the float32 values alone)."""
    L, _, H, C, hd = shape
    n = L * H * C * hd
    if bits == RAW:
        return 2 * n * 4
    return 2 * n * bits // 8 + 4 * n // C + 4 * n // GROUP


def chunk_parts(buf: np.ndarray, shape, bits: int) -> list[np.ndarray]:
    """Views of the six arrays of chunks at `bits` in buf (uint8 [..., packed_bytes]): keys' codes
    [..., L, H, hd, C * bits / 8], their scales and biases [..., L, H, hd, 1] (float16), values'
    codes [..., L, H, C, hd * bits / 8], their scales and biases [..., L, H, C, hd / GROUP]."""
    L, _, H, C, hd = shape
    lead = buf.shape[:-1]
    dims = [
        (np.uint8, (L, H, hd, C * bits // 8)),
        (np.float16, (L, H, hd, 1)),
        (np.float16, (L, H, hd, 1)),
        (np.uint8, (L, H, C, hd * bits // 8)),
        (np.float16, (L, H, C, hd // GROUP)),
        (np.float16, (L, H, C, hd // GROUP)),
    ]
    parts, pos = [], 0
    for dtype, d in dims:
        nbytes = int(np.prod(d)) * np.dtype(dtype).itemsize
        parts.append(buf[..., pos : pos + nbytes].view(dtype).reshape(*lead, *d))
        pos += nbytes
    return parts


def encode(x: np.ndarray, bits: int) -> bytes:
    """A chunk [layers, 2, Hkv, C, hd] at `bits`, as coded_chunks.chunk_parts lays it out. Keys are
    quantized per channel over the chunk's tokens (their outliers sit in fixed channels; per-token
    groups would spend the range on them), values per token along the head dimension (as KIVI does)."""
    C = x.shape[3]
    keys = np.ascontiguousarray(x[:, 0].swapaxes(-1, -2))  # [L, H, hd, C]
    parts = quantize(keys, bits, C) + quantize(x[:, 1], bits, GROUP)
    return b"".join(p.tobytes() for p in parts)


def decode(buf: np.ndarray, shape, bits: int, out: np.ndarray | None = None, layer: int | None = None) -> np.ndarray:
    """The inverse of encode: bytes (uint8 [..., n]) -> float32 [..., *shape], written into `out` when
    given; or (one chunk's bytes) one layer's [2, Hkv, C, hd] alone."""
    kc, ks, kb, vc, vs, vb = chunk_parts(buf[..., : packed_bytes(shape, bits)], shape, bits)
    if layer is not None:
        kc, ks, kb, vc, vs, vb = (p[layer][None] for p in (kc, ks, kb, vc, vs, vb))
        shape = (1, *shape[1:])
    if out is None:
        out = np.empty(kc.shape[:-4] + tuple(shape), np.float32)
    dequantize(kc, ks, kb, bits, shape[3], out=out[..., 0, :, :, :].swapaxes(-1, -2))
    dequantize(vc, vs, vb, bits, GROUP, out=out[..., 1, :, :, :])
    return out if layer is None else out[0]


@lru_cache(maxsize=None)
def layer_bytes(shape, bits: int, layer: int) -> np.ndarray:
    """Where layer `layer`'s bytes lie in a chunk at `bits` (int64 offsets), in the order a chunk of
    that one layer holds them: gathered, they are a one-layer chunk (shape (1, 2, H, C, hd))."""
    if bits == RAW:
        n = int(np.prod(shape[1:])) * 4
        return np.arange(layer * n, (layer + 1) * n)
    base = np.zeros(packed_bytes(shape, bits), np.uint8)
    at = base.ctypes.data
    return np.concatenate(
        [
            np.arange(p[layer].ctypes.data - at, p[layer].ctypes.data - at + p[layer].nbytes)
            for p in chunk_parts(base, shape, bits)
        ]
    )


@lru_cache(maxsize=None)  # (a model's layers x CLASSES per chunk shape: built once each, asked every step)
def class_layouts(shape, layer: int) -> tuple[tuple[CodedLayout, CodedLayout], ...]:
    """layer_layouts of every class (CLASSES order), what attention takes for one layer."""
    return tuple(layer_layouts(shape, bits, layer) for bits in CLASSES)


def layer_layouts(shape, bits: int, layer: int) -> tuple[CodedLayout, CodedLayout]:
    """(keys' layout, values' layout) of layer `layer` of chunks at `bits` in an arena, block index =
    byte offset / UNIT, as the kernel reads them (kernels/kv_codes.py); RAW: float32 [L, 2, H, C, hd]."""
    if bits == RAW:
        _, _, H, C, hd = shape
        strides = (UNIT // 4, C * hd, hd, 1)
        return tuple(raw_layout((2 * layer + j) * H * C * hd * 4, strides, C) for j in (0, 1))
    size = packed_bytes(shape, bits)
    base = np.zeros(size + UNIT, np.uint8)
    # two blocks UNIT bytes apart: the views' first axis steps one arena unit
    two = np.lib.stride_tricks.as_strided(base, (2, size), (UNIT, 1))
    kc, ks, kb, vc, vs, vb = (p[:, layer] for p in chunk_parts(two, shape, bits))
    C = shape[3]
    # the kernel's index order: (block, head, token, channel); keys are packed along tokens
    _, kl = from_views(kc.transpose(0, 1, 3, 2), ks.transpose(0, 1, 3, 2), kb.transpose(0, 1, 3, 2), bits, "tokens",
                       C, 1, C)  # fmt: skip
    _, vl = from_views(vc, vs, vb, bits, "channels", 1, GROUP, C)
    return kl, vl


def floats(payload: np.ndarray, shape, bits: int, layer: int | None = None) -> np.ndarray:
    """A chunk's float32 values [L, 2, H, C, hd] (or one layer's [2, H, C, hd]) from its bytes: the
    RAW ones as they are, codes dequantized (decode)."""
    if bits != RAW:
        return decode(payload, shape, bits, layer=layer)
    x = payload[: packed_bytes(shape, RAW)].view(np.float32).reshape(shape)
    return x if layer is None else x[layer]


def units(nbytes: int) -> int:
    return -(-nbytes // UNIT)


class CodedArena:
    """Compressed chunks in one uint8 buffer, allocated whole: host memory the backend allocated
    (`host`, written and read with numpy as the reader pool fills buffers) and the backend's array
    over it without a copy (`buffer`, what attention reads)."""

    def __init__(self, ops, nbytes: int):
        self.n_units = nbytes // UNIT
        self.host = ops.host_buffer(max(self.n_units, 1) * UNIT)
        self.host[:] = 0
        self.buffer = ops.host_array(self.host)
        self._free = [(0, self.n_units)] if self.n_units else []  # (first unit, units), by position
        self._held: dict[int, tuple[int, int]] = {}  # first unit -> (units, bits)
        self._refs: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return self.n_units * UNIT

    @property
    def used_bytes(self) -> int:
        return sum(n for n, _ in self._held.values()) * UNIT

    def can_hold(self, nbytes: int) -> bool:
        need = units(nbytes)
        return any(n >= need for _, n in self._free)

    def place(self, data: np.ndarray, bits: int) -> int:
        """Store a chunk's bytes (uint8 [packed_bytes]); returns its first unit."""
        need = units(data.size)
        for k, (at, n) in enumerate(self._free):
            if n >= need:
                self._free[k : k + 1] = [(at + need, n - need)] if n > need else []
                self.host[at * UNIT : at * UNIT + data.size] = data
                self._held[at] = (need, bits)
                self._refs[at] = 1
                return at
        raise MemoryBudgetError(f"the compressed chunks' {self.nbytes / 1e6:.1f} MB hold no {data.size} more bytes")

    def bits(self, at: int) -> int:
        return self._held[at][1]

    def read(self, at: int, nbytes: int) -> np.ndarray:
        """A copy of the chunk's bytes."""
        return self.host[at * UNIT : at * UNIT + nbytes].copy()

    def layer_floats(self, ats, shape, bits: int, layer: int, values: bool) -> np.ndarray:
        """Layer `layer`'s keys (or values) of the chunks at units `ats`, all of `bits`, as float32 [n, H,
        C, hd]: their bytes of that layer gathered at once, then dequantized together (RAW: as they are)."""
        raw = self.host[(np.asarray(ats, np.int64) * UNIT)[:, None] + layer_bytes(shape, bits, layer)[None, :]]
        if bits == RAW:
            return raw.view(np.float32).reshape(len(ats), *shape[1:])[:, int(values)]
        c, s, b = chunk_parts(raw, (1, *shape[1:]), bits)[3 * int(values) : 3 * int(values) + 3]
        if values:
            return dequantize(c, s, b, bits, GROUP)[:, 0]
        return dequantize(c, s, b, bits, shape[3])[:, 0].swapaxes(-1, -2)  # keys are stored [hd, C]

    def share(self, at: int) -> None:
        self._check(at)
        self._refs[at] += 1

    def is_shared(self, at: int) -> bool:
        return self._refs[at] > 1

    def release(self, at: int) -> bool:
        """Drop one holder; returns whether its bytes became free."""
        self._check(at)
        self._refs[at] -= 1
        if self._refs[at]:
            return False
        del self._refs[at]
        n, _ = self._held.pop(at)
        ranges = sorted(self._free + [(at, n)])
        merged: list[tuple[int, int]] = []
        for a, m in ranges:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + m)
            else:
                merged.append((a, m))
        self._free = merged
        return True

    def _check(self, at: int) -> None:
        if at not in self._refs:
            raise ValueError(f"no compressed chunk is held at arena unit {at}")
