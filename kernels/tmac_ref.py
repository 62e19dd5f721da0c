"""Plain-ops reference of the T-MAC product (cpu/tmac.cpp): y = x @ W^T for one row x and affine 4-bit
weights in groups of 32 (W[n, k] = s[n, g] * c[n, k] + b[n, g]), computed by table lookup as in T-MAC
(Wei et al., EuroSys 2025) instead of by multiplying codes:

  c = sum_j 2^j c_j (bit planes j = 0..3), so  sum_k c[n, k] x[k] = sum_j 2^j sum_i T_i[idx(n, j, i)],

where run i is inputs 4i .. 4i + 3, T_i[idx] the sum of those of its inputs whose bit is set in idx (16
entries, built once per token and shared by every row) and idx(n, j, i) the 4-bit index of the run's
four weights' bit j. The tables are quantized to int8 with one scale per group of 32 inputs, so the
lookups add up exactly in integers; the group's scale and bias are applied in float32.

The kernel equals this reference bit for bit: every float32 operation below (table sums, the table
scale, the quantization's product and its rounding half to even, the group sum, and the per-group
fused multiply-adds) is one correctly rounded operation in a fixed order, and the lookups' sums
are integers, exact in any order. The kernel's paths and thread counts therefore agree to the bit too."""

from __future__ import annotations

import numpy as np

from mlx_flash.kernels.qmatmul import unpack_codes

GROUP = 32  # inputs per scale and bias (the store's group), and per table scale
RUN = 4  # inputs per table (T-MAC's g): 2^4 = 16 entries, one 128-bit lane of a byte shuffle
PLANES = 4  # bits per code
ROWS = 16  # rows per block of the repacked layout (one int32 lane each in a 512-bit register)
RECORD = 4 * 64 + 2 * ROWS * 2  # bytes of one block's group: 4 run pairs of 64 bytes, 16 scales, 16 biases
F32 = np.float32


def tables(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [K] float32 (K a multiple of 32) -> (tables int8 [K / 4, 16], table scales float32 [K / 32],
    group sums float32 [K / 32]).

    T[idx] = T[idx - 2^m] + x_m for idx's highest bit m (T[0] = 0): the inputs added in increasing
    order. A group's scale d = max |T| / 127 over its 8 runs' entries; entries are round-half-even(T *
    (127 / max |T|)), all in float32. The group sum is T[15] of the 8 runs added as a tree:
    ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))."""
    x = np.asarray(x, dtype=F32)
    K = x.shape[0]
    if K % GROUP:
        raise ValueError(f"K must be a multiple of {GROUP} (got {K})")
    runs = x.reshape(K // RUN, RUN)
    t = np.zeros((K // RUN, 1), F32)
    for m in range(RUN):
        t = np.concatenate([t, (t + runs[:, m : m + 1]).astype(F32)], axis=1)
    per_group = t.reshape(K // GROUP, GROUP // RUN * 16)
    amax = np.abs(per_group).max(axis=1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint((per_group * inv[:, None]).astype(F32)).astype(np.int8).reshape(K // RUN, 16)
    s = t[:, 15].reshape(K // GROUP, GROUP // RUN)
    while s.shape[1] > 1:
        s = (s[:, 0::2] + s[:, 1::2]).astype(F32)
    return q, d, s[:, 0]


def group_sums(packed: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The integer part: I[n, g] = sum over the group's runs i and planes j of 2^j q[i, idx(n, j, i)],
    int64 [N, K / 32]."""
    codes = unpack_codes(packed, 4).astype(np.int64)  # [N, K]
    N, K = codes.shape
    runs = codes.reshape(N, K // RUN, RUN)
    lookups = np.zeros((N, K // RUN), np.int64)
    for j in range(PLANES):
        plane = (runs >> j) & 1
        idx = plane[..., 0] | plane[..., 1] << 1 | plane[..., 2] << 2 | plane[..., 3] << 3  # [N, K / 4]
        lookups += q[np.arange(K // RUN)[None, :], idx].astype(np.int64) << j
    return lookups.reshape(N, K // GROUP, GROUP // RUN).sum(axis=2)


def tmac_matvec_ref(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """y [N] float32 = x [K] @ W^T by table lookup; packed uint32 [N, K / 8] (the store's words),
    scales, biases float16 [N, K / 32]. Per row, group by group in order:
    y = fma(float(I), s * d, y);  y = fma(b, xsum, y)  (float32; a fused multiply-add rounds once)."""
    q, d, xs = tables(x)
    total = group_sums(packed, q)
    s, b = scales.astype(F32), biases.astype(F32)
    y = np.zeros(packed.shape[0], F32)
    for g in range(total.shape[1]):
        y = fma32(total[:, g].astype(F32), (s[:, g] * d[g]).astype(F32), y)
        y = fma32(b[:, g], np.full_like(y, xs[g]), y)
    return y


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c rounded once to float32, as a fused multiply-add: the product is exact in float64, the
    sum rounded to float64 with round-to-odd (TwoSum's exact error decides), which leaves a float64
    that rounds to the correctly rounded float32 (53 >= 24 + 2 bits: Boldo and Melquiond, 2008)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    cv = s - p
    e = (p - (s - cv)) + (c - cv)  # TwoSum: p + c = s + e exactly
    even = (s.view(np.int64) & 1) == 0
    s = np.where((e != 0) & even, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def repack_ref(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """The store's matrix in the T-MAC layout the kernel reads (uint8, a different layout from the
    store's bytes, the same size but for the last block's padding rows): blocks of 16 rows, each a
    record of RECORD bytes per group, in order:

      4 run pairs p of the group (inputs 8p .. 8p + 7, one store word): 16 dwords, dword r = row r's
        word with its bits transposed, byte j = plane j: bit t of byte j = bit j of code t, so the low
        nibble indexes run 2p's table and the high nibble run 2p + 1's
      the 16 rows' scales (float16), then their biases

    Rows past N are zeros."""
    N, words = packed.shape
    K = words * 8
    groups, blocks = K // GROUP, -(-N // ROWS)
    w = np.zeros((blocks * ROWS, words), np.uint32)
    w[:N] = packed
    t = np.zeros_like(w)
    for j in range(PLANES):
        for b in range(8):  # bit 4b + j of the word -> bit 8j + b
            t |= ((w >> np.uint32(4 * b + j)) & np.uint32(1)) << np.uint32(8 * j + b)
    t = t.reshape(blocks, ROWS, groups, 4).transpose(0, 2, 3, 1)  # [block, group, pair, row]
    sb = np.zeros((2, blocks * ROWS, groups), np.float16)
    sb[0, :N], sb[1, :N] = scales, biases
    sb = sb.reshape(2, blocks, ROWS, groups).transpose(1, 3, 0, 2)  # [block, group, scale|bias, row]
    parts = [np.ascontiguousarray(a.reshape(blocks, groups, -1)).view(np.uint8) for a in (t, sb)]
    return np.concatenate(parts, axis=2).reshape(-1)
