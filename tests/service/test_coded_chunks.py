"""Compressed chunks where they lie (service/coded_chunks.py): the layouts read what decode gives,
attention over chunks of mixed widths in one arena (kernels/cpu/attention.cpp mf_attention_mixed, as
the MLX primitive and the torch operator) equals the float kernel over the dequantized chunks bit
for bit, and the arena's ranges are handed out and merged back."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlx_flash.backends.torch import TorchOps
from mlx_flash.errors import MemoryBudgetError
from mlx_flash.kernels import mlx_kernels, torch_ops
from mlx_flash.kernels.attention_ref import attention_ref
from mlx_flash.kernels.kv_codes import pairs_ints
from mlx_flash.service.chunk_pool import ChunkShape
from mlx_flash.service.coded_chunks import UNIT, WIDTHS, CodedArena, decode, encode, layer_layouts, packed_bytes

SHAPE = ChunkShape(layers=2, kv_heads=2, head_dim=64, tokens=16)


def _chunks(rng, n):
    return [rng.standard_normal(SHAPE.array_shape).astype(np.float32) for _ in range(n)]


def _arena(chunks, widths):
    """A numpy arena holding the chunks at `widths` (0: not coded), each on a UNIT boundary after a
    gap, and the units they start at."""
    buf, at = [], []
    pos = 3  # a chunk need not start at unit 0
    for x, w in zip(chunks, widths):
        if not w:
            at.append(-1)
            continue
        data = np.frombuffer(encode(x, w), np.uint8)
        at.append(pos)
        need = -(-data.size // UNIT) + 1
        buf.append((pos, data))
        pos += need
    arena = np.zeros(pos * UNIT, np.uint8)
    for p, data in buf:
        arena[p * UNIT : p * UNIT + data.size] = data
    return arena, at


@pytest.mark.parametrize("bits", WIDTHS)
def test_the_layouts_read_what_decode_gives(bits):
    rng = np.random.default_rng(bits)
    chunks = _chunks(rng, 2)
    arena, at = _arena(chunks, [bits, bits])
    for layer in range(SHAPE.layers):
        kl, vl = layer_layouts(SHAPE.array_shape, bits, layer)
        with np.errstate(invalid="ignore", over="ignore"):  # the gaps between chunks read as garbage
            full_k = kl.dequantize(arena, max(at) + 1, SHAPE.kv_heads, SHAPE.tokens, SHAPE.head_dim)
            full_v = vl.dequantize(arena, max(at) + 1, SHAPE.kv_heads, SHAPE.tokens, SHAPE.head_dim)
        for x, a in zip(chunks, at):
            want = decode(arena[a * UNIT :], SHAPE.array_shape, bits)[layer]
            assert np.array_equal(full_k[a], want[0]) and np.array_equal(full_v[a], want[1])


def _mixed_case(rng, T):
    """Two rows over a float pool and coded chunks of every width, in scattered slots."""
    chunks = _chunks(rng, 7)
    widths = [8, 0, 4, 2, 0, 4, 8]
    arena, at = _arena(chunks, widths)
    slots = 4
    pool = rng.standard_normal((SHAPE.layers, 2, slots, SHAPE.kv_heads, SHAPE.tokens, SHAPE.head_dim)).astype(
        np.float32
    )
    float_slot = {1: 2, 4: 0}  # chunk -> pool slot
    for i, s in float_slot.items():
        pool[:, :, s] = chunks[i].transpose(0, 1, 2, 3, 4)
    rows = [[0, 1, 2, 3], [4, 5, 6]]
    kv_len = np.array([3 * 16 + 5, 2 * 16 + 16], np.int32)
    table = np.zeros((2, 4), np.int32)
    classes = np.zeros((2, 4), np.int32)
    for b, row in enumerate(rows):
        for j, i in enumerate(row):
            if widths[i]:
                table[b, j], classes[b, j] = at[i], WIDTHS.index(widths[i]) + 1
            else:
                table[b, j] = float_slot[i]
    q = rng.standard_normal((2, 6, T, SHAPE.head_dim)).astype(np.float32)
    return chunks, widths, arena, pool, rows, table, classes, kv_len, kv_len - T, q


def _dequantized_pool(chunks, widths, pool, rows, layer, j):
    """keys (j=0) or values (j=1) of layer as a float pool [blocks, H, C, hd] with table rows b*4+i."""
    out = np.zeros((8, SHAPE.kv_heads, SHAPE.tokens, SHAPE.head_dim), np.float32)
    for b, row in enumerate(rows):
        for n, i in enumerate(row):
            x = chunks[i]
            if widths[i]:
                x = decode(np.frombuffer(encode(x, widths[i]), np.uint8), SHAPE.array_shape, widths[i])
            out[b * 4 + n] = x[layer, j]
    return out


@pytest.mark.parametrize("T", [1, 3])
def test_attention_over_mixed_widths_equals_the_float_kernel_over_the_dequantized_chunks(T):
    rng = np.random.default_rng(T)
    chunks, widths, arena, pool, rows, table, classes, kv_len, q_pos, q = _mixed_case(rng, T)
    flat = np.arange(8, dtype=np.int32).reshape(2, 4)
    for layer in range(SHAPE.layers):
        kf = _dequantized_pool(chunks, widths, pool, rows, layer, 0)
        vf = _dequantized_pool(chunks, widths, pool, rows, layer, 1)
        want = np.array(
            mlx_kernels.attention(mx.array(q), mx.array(kf), mx.array(vf), 0.125, 1, mx.array(kv_len),
                                  mx.array(q_pos), mx.array(flat))
        )  # fmt: skip
        ref = attention_ref(q, kf, vf, 0.125, kv_len, q_pos, flat)
        assert np.abs(want - ref).max() < 1e-4
        layouts = [layer_layouts(SHAPE.array_shape, w, layer) for w in WIDTHS]
        k, v = pool[layer, 0], pool[layer, 1]
        got_mlx = mlx_kernels.attention_mixed(
            mx.array(q), mx.array(k), mx.array(v), 0.125, 2, mx.array(arena), layouts, mx.array(kv_len),
            mx.array(q_pos), mx.array(table), mx.array(classes),
        )  # fmt: skip
        t = torch.from_numpy
        ints = pairs_ints(tuple(layouts))
        got_torch = torch_ops.ops().attention_mixed(
            t(q), t(k), t(v), 0.125, 1, t(arena), ints, t(kv_len), t(q_pos), t(table), t(classes)
        )
        assert np.array_equal(np.array(got_mlx), want)
        assert np.array_equal(got_torch.numpy(), want)


def test_a_class_or_block_outside_the_buffer_is_refused():
    rng = np.random.default_rng(9)
    chunks, widths, arena, pool, rows, table, classes, kv_len, q_pos, q = _mixed_case(rng, 1)
    layouts = [layer_layouts(SHAPE.array_shape, w, 0) for w in WIDTHS]
    t = torch.from_numpy
    ints = pairs_ints(tuple(layouts))
    bad = classes.copy()
    bad[0, 0] = 4
    with pytest.raises(RuntimeError, match="attention_mixed"):
        torch_ops.ops().attention_mixed(t(q), t(pool[0, 0]), t(pool[0, 1]), 0.125, 1, t(arena), ints, t(kv_len),
                                        t(q_pos), t(table), t(bad))  # fmt: skip
    far = table.copy()
    far[0, 0] = arena.size // UNIT  # a coded chunk past the arena's end
    with pytest.raises(RuntimeError, match="attention_mixed"):
        torch_ops.ops().attention_mixed(t(q), t(pool[0, 0]), t(pool[0, 1]), 0.125, 1, t(arena), ints, t(kv_len),
                                        t(q_pos), t(far), t(classes))  # fmt: skip


def test_the_arena_hands_out_ranges_and_merges_them_back():
    size = packed_bytes(SHAPE.array_shape, 4)
    arena = CodedArena(TorchOps(), 3 * size + UNIT)
    data = [np.full(size, i + 1, np.uint8) for i in range(3)]
    at = [arena.place(d, 4) for d in data]
    assert at[0] == 0 and len(set(at)) == 3 and not arena.can_hold(size)
    with pytest.raises(MemoryBudgetError):
        arena.place(data[0], 4)
    for a, d in zip(at, data):
        assert np.array_equal(arena.read(a, size), d) and arena.bits(a) == 4
    arena.share(at[1])
    assert arena.is_shared(at[1]) and not arena.release(at[1])
    assert arena.release(at[0]) and arena.release(at[1])  # neighbours: one free range of two chunks
    assert arena.can_hold(2 * size - UNIT)
    with pytest.raises(ValueError, match="no compressed chunk"):
        arena.release(at[0])
