"""Plain-ops reference of the sparse FFN kernels (CPU, Metal, CUDA): unpack the active bundles of a
slab (slab_spec.py) with numpy, dequantize to float64, multiply. What every kernel must equal up to
float32 rounding; nothing on the per-token path calls it.

  sparse_gate_up(x, slab, idx, count)  h[t, j*block + r] = silu(x[t]·gate_r(idx[j])) * (x[t]·up_r(idx[j]))
  sparse_down(h, slab, idx, count)     y[t, d] = sum over j < count, r < block of down_r(idx[j])[d] * h[t, j*block + r]

idx[0:count] are slot ids (rows of the slab); entries past count are never read. `random_slab`
builds test vectors in the store's layout for every kernel's tests.
"""

from __future__ import annotations

import numpy as np

from .slab_spec import SCALE_BYTES, DownLayout, Matrix, ScaleType, SlabSpec

_NP_SCALE = {ScaleType.F16: np.float16, ScaleType.F32: np.float32}


def _scales(raw: np.ndarray, st: ScaleType) -> np.ndarray:
    """Raw scale bytes [..., n * size] -> float64 [..., n]."""
    if st is ScaleType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.view(_NP_SCALE[st]).astype(np.float64)


def _codes(words: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words [..., n] -> codes [..., n * 32/bits] (float64)."""
    per = 32 // bits
    c = (words[..., None] >> (bits * np.arange(per, dtype=np.uint32))) & np.uint32((1 << bits) - 1)
    return c.reshape(*words.shape[:-1], words.shape[-1] * per).astype(np.float64)


def _part(rows: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    return np.ascontiguousarray(rows[:, offset : offset + nbytes])


def dequantized(slab: np.ndarray, idx: np.ndarray, count: int, spec: SlabSpec, name: str) -> np.ndarray:
    """One matrix of bundles idx[:count] in float64: gate/up [count*block, D] (row = neuron), down
    [D, count*block] (column = neuron)."""
    rows = slab[np.asarray(idx[:count], dtype=np.int64)]
    m: Matrix = getattr(spec, name)
    n, D, B = rows.shape[0], spec.d_model, spec.block
    sb = SCALE_BYTES[spec.scale_type]
    q = _codes(_part(rows, m.w, spec.words_bytes(name)).view(np.uint32), m.bits)
    s = _scales(_part(rows, m.s, spec.scales_count(name) * sb), spec.scale_type)
    b = _scales(_part(rows, m.b, spec.scales_count(name) * sb), spec.scale_type)
    if name == "down" and spec.down_layout is DownLayout.BLOCK:  # [n, D, B] codes, one group per (bundle, d)
        w = q.reshape(n, D, B) * s.reshape(n, D, 1) + b.reshape(n, D, 1)
        return w.transpose(1, 0, 2).reshape(D, n * B)
    # rows quantized along D: gate/up [n*B, D]; a column down [n, D]
    q = q.reshape(n * B, D // m.group, m.group)
    w = q * s.reshape(n * B, D // m.group, 1) + b.reshape(n * B, D // m.group, 1)
    w = w.reshape(n * B, D)
    return w.T if name == "down" else w


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def sparse_gate_up_ref(x: np.ndarray, slab: np.ndarray, idx: np.ndarray, count: int, spec: SlabSpec) -> np.ndarray:
    """x [T, D] -> h [T, count*block] (float64)."""
    x = np.asarray(x, dtype=np.float64)
    g = x @ dequantized(slab, idx, count, spec, "gate").T
    u = x @ dequantized(slab, idx, count, spec, "up").T
    return silu(g) * u


def sparse_down_ref(h: np.ndarray, slab: np.ndarray, idx: np.ndarray, count: int, spec: SlabSpec) -> np.ndarray:
    """h [T, >= count*block] (entries past count*block ignored) -> y [T, D] (float64)."""
    h = np.asarray(h, dtype=np.float64)[:, : count * spec.block]
    return h @ dequantized(slab, idx, count, spec, "down").T


def random_slab(
    rng: np.random.Generator,
    slots: int,
    d_model: int,
    block: int,
    bits: int = 4,
    group: int = 32,
    scale_type: ScaleType = ScaleType.F16,
    down_bits: int | None = None,
    down_group: int | None = None,
    pad: int = 0,
) -> tuple[np.ndarray, SlabSpec]:
    """A slab of `slots` random bundles and its spec, laid out like the store's (gate | up | down,
    each words | scales | biases, 4-byte aligned), plus `pad` spare bytes per row. Block layout
    for block > 1 (down group = block), column layout for block 1 (down group `down_group`)."""
    down_bits = down_bits or bits
    layout = DownLayout.BLOCK if block > 1 else DownLayout.COLUMN
    dgroup = block if layout is DownLayout.BLOCK else (down_group or group)
    sb = SCALE_BYTES[scale_type]
    pos, mats = 0, {}
    parts = []
    for name, nb, gs in (("gate", bits, group), ("up", bits, group), ("down", down_bits, dgroup)):
        if name == "down" and layout is DownLayout.BLOCK:
            wbytes, ns = d_model * block * nb // 8, d_model
        else:
            wbytes, ns = block * d_model * nb // 8, block * d_model // gs
        w = pos
        s = w + wbytes
        b = s + ns * sb
        pos = -(-(b + ns * sb) // 4) * 4
        mats[name] = Matrix(w, s, b, nb, gs)
        parts.append((w, wbytes, s, b, ns))
    row_bytes = pos + pad
    spec = SlabSpec(d_model, block, row_bytes, mats["gate"], mats["up"], mats["down"], layout, scale_type)
    slab = rng.integers(0, 256, size=(slots, row_bytes), dtype=np.uint8)  # codes: any bytes are valid
    for w, wbytes, s, b, ns in parts:
        scale = (rng.standard_normal((slots, ns)) * 0.02).astype(np.float32)
        bias = (rng.standard_normal((slots, ns)) * 0.02).astype(np.float32)
        for off, v in ((s, scale), (b, bias)):
            if scale_type is ScaleType.F32:
                raw = v.view(np.uint8)
            elif scale_type is ScaleType.F16:
                raw = v.astype(np.float16).view(np.uint8)
            else:
                raw = (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            slab[:, off : off + ns * sb] = raw.reshape(slots, -1)
    return slab, spec
