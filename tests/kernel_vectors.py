"""Test vectors of the stored layouts the CPU kernels read, shared by the kernel tests: affine
matrices in the store's layout, the same laid out as bundles interleave them, GGUF block rows."""

import numpy as np

from mlx_flash.kernels.gguf_blocks_ref import BLOCKS


def quantized(rng, rows, cols, bits, group, scale_dtype=np.float16):
    """Random codes, scales and biases in the store's layout (uint32 words, code j at bits*(j % per))."""
    per = 32 // bits
    codes = rng.integers(0, 1 << bits, size=(rows, cols), dtype=np.uint32)
    words = np.zeros((rows, cols // per), dtype=np.uint32)
    for j in range(per):
        words |= codes[:, j::per] << np.uint32(bits * j)
    scales = (rng.standard_normal((rows, cols // group)) * 0.02).astype(scale_dtype)
    biases = (rng.standard_normal((rows, cols // group)) * 0.1).astype(scale_dtype)
    return codes, words, scales, biases


def lay_out(words, scales, biases, bits, group, rows_per_block, as_groups):
    """The matrix written into a byte buffer the way the store's bundles interleave it, returning
    the kernel's views of it. as_groups=False: blocks of `rows_per_block` rows, each block in its own
    bundle (gate/up rows). as_groups=True: each group of every row in its own bundle (the down
    matrix of a block store: bundle b holds group b of every row). Padding bytes between fields
    are filled with junk so a kernel reading outside its fields gets a wrong answer."""
    rows, words_per_row = words.shape
    groups, wpg = scales.shape[1], group * bits // 32
    rng = np.random.default_rng(7)
    if as_groups:
        code_bytes, scale_bytes = rows * wpg * 4, rows * 2
        n_bundles, pad = groups, 12
        bundle = code_bytes + 2 * scale_bytes + pad
        buf = rng.integers(0, 255, size=n_bundles * bundle, dtype=np.uint8)
        for b in range(groups):
            o = b * bundle
            buf[o : o + code_bytes] = words[:, b * wpg : (b + 1) * wpg].copy().view(np.uint8).reshape(-1)
            buf[o + code_bytes : o + code_bytes + scale_bytes] = scales[:, b].copy().view(np.uint8)
            buf[o + code_bytes + scale_bytes : o + code_bytes + 2 * scale_bytes] = biases[:, b].copy().view(np.uint8)
        w = np.ndarray((1, rows, groups, wpg), np.uint32, buf, 0, (0, wpg * 4, bundle, 4))
        s = np.ndarray((1, rows, groups), np.float16, buf, code_bytes, (0, 2, bundle))
        bi = np.ndarray((1, rows, groups), np.float16, buf, code_bytes + scale_bytes, (0, 2, bundle))
        return w, s, bi
    R = rows_per_block
    code_bytes, scale_bytes = R * words_per_row * 4, R * groups * 2
    n_bundles, pad = rows // R, 20
    bundle = code_bytes + 2 * scale_bytes + pad
    buf = rng.integers(0, 255, size=n_bundles * bundle, dtype=np.uint8)
    for b in range(n_bundles):
        o, sl = b * bundle, slice(b * R, (b + 1) * R)
        buf[o : o + code_bytes] = words[sl].copy().view(np.uint8).reshape(-1)
        buf[o + code_bytes : o + code_bytes + scale_bytes] = scales[sl].copy().view(np.uint8).reshape(-1)
        buf[o + code_bytes + scale_bytes : o + code_bytes + 2 * scale_bytes] = (
            biases[sl].copy().view(np.uint8).reshape(-1)
        )
    w = np.ndarray((n_bundles, R, groups, wpg), np.uint32, buf, 0, (bundle, words_per_row * 4, wpg * 4, 4))
    s = np.ndarray((n_bundles, R, groups), np.float16, buf, code_bytes, (bundle, groups * 2, 2))
    bi = np.ndarray((n_bundles, R, groups), np.float16, buf, code_bytes + scale_bytes, (bundle, groups * 2, 2))
    return w, s, bi


def random_bytes(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Blocks of random bytes (every code and scale bit pattern), their float16 fields finite."""
    blk = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // blk.weights, blk.nbytes), dtype=np.uint8)
    halves = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[kind]
    for at in halves:
        d = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)
