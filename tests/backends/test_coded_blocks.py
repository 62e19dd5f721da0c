"""Compressed KV blocks (models/kv_coded_blocks.py) as attention reads them (backends/coded_blocks.py):
the layout's plain-indexing reading (kernels/kv_codes.CodedLayout.dequantize, the reference the
kernel equals) gives exactly what BlockFormat.decode gives, keys grouped per channel over a block
and values per token, at every width; a wrong shape is refused naming it."""

import numpy as np
import pytest

from mlx_flash.backends.coded_blocks import block_layouts
from mlx_flash.models.kv_coded_blocks import BlockFormat


@pytest.mark.parametrize("bits,heads,hd", [(8, 2, 64), (4, 3, 32), (2, 1, 16)])
def test_the_layouts_read_what_decode_gives(bits, heads, hd):
    fmt = BlockFormat(bits, heads, hd, 16)
    rng = np.random.default_rng(bits)
    k, v = (rng.standard_normal((heads, 48, hd)).astype(np.float32) for _ in range(2))
    blocks = fmt.encode(k, v)
    assert blocks.shape == (3, fmt.nbytes)
    keys, values = fmt.decode(blocks)
    step = {8: 0.02, 4: 0.3, 2: 1.5}[bits]  # a quantization step of standard normals' range, and more
    assert 0 < np.abs(keys - k).max() < step and 0 < np.abs(values - v).max() < step
    kl, vl, table = block_layouts(fmt, 3)
    assert table.tolist() == [[0, 1, 2]]
    flat = blocks.reshape(-1)
    for layout, want in ((kl, keys), (vl, values)):
        got = layout.dequantize(flat, 3, heads, 16, hd)  # [blocks, heads, tokens, hd]
        assert np.array_equal(got.transpose(1, 0, 2, 3).reshape(heads, 48, hd), want)


def test_bad_shapes_and_widths_are_refused():
    with pytest.raises(ValueError, match="at 3 bits: 8, 4 or 2"):
        BlockFormat(3, 2, 64, 16)
    fmt = BlockFormat(4, 2, 64, 16)
    with pytest.raises(ValueError, match="do not split into them"):
        fmt.encode(np.zeros((2, 20, 64), np.float32), np.zeros((2, 20, 64), np.float32))
    with pytest.raises(ValueError, match=r"uint8 \[blocks, \d+\] expected"):
        fmt.decode(np.zeros((2, 10), np.uint8))


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("T", [1, 5])
def test_attention_over_the_blocks_equals_the_float_kernel_over_their_decoded_values(backend, bits, T):
    """ops.sdpa_coded over blocks of 64 tokens named by the slot table (the kernel's whole-block
    path), in a read buffer longer than they are, grouped heads, a float window after them."""
    from mlx_flash.backends import get_backend

    ops = get_backend(backend, device="cpu", threads=2)
    H, hd, n, r = 2, 64, 3 * 64, 37
    fmt = BlockFormat(bits, H, hd, 64)
    rng = np.random.default_rng(bits * 10 + T)
    k, v = (rng.standard_normal((H, n, hd)).astype(np.float32) for _ in range(2))
    blocks = fmt.encode(k, v)
    keys, values = fmt.decode(blocks)
    wk, wv = (rng.standard_normal((1, H, r, hd)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 2 * H, T, hd)).astype(np.float32)
    room = np.zeros((5, fmt.nbytes), np.uint8)  # a read buffer longer than what it holds
    room[:3] = blocks
    got = ops.to_numpy(
        ops.sdpa_coded(*(ops.array(a) for a in (q, wk, wv)), hd**-0.5, ops.array(room, cast=False), fmt, n)
    )
    K = np.concatenate([keys[None], wk], axis=2)
    V = np.concatenate([values[None], wv], axis=2)
    want = ops.to_numpy(ops.sdpa(*(ops.array(a) for a in (q, K, V)), hd**-0.5, "causal"))
    assert np.array_equal(got, want)
