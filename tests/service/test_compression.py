"""KV chunk compression: the options, group-wise quantization round trips, the width assignment
(mean width at most the target, densest widest), the attention-mass op on both backends against
its numpy reference, and compressed swap files."""

import numpy as np
import pytest

from mlx_flash.backends import get_backend
from mlx_flash.errors import ConfigError
from mlx_flash.service.chunk_pool import ChunkShape
from mlx_flash.models.kv_quant import dequantize, quantize
from mlx_flash.service.compression import (
    Compression,
    DensityTracker,
    Scheme,
    assign_widths,
    choose_widths,
    attention_columns_ref,
    lossy,
)
from mlx_flash.service.coded_chunks import decode, encode, packed_bytes
from mlx_flash.service.swap_files import SwapDir, chunk_data, file_bytes, payload_bytes


def test_options_parse_and_refuse():
    assert Compression.parse(None).scheme is Scheme.OFF and Compression.parse("off") == Compression()
    assert Compression.parse("static:4") == Compression(Scheme.STATIC, bits=4)
    assert (
        Compression.parse("tolerance:0.5").ratio == 0.5 and str(Compression.parse("tolerance:0.5")) == "tolerance:0.5"
    )
    for bad in ("static:3", "tolerance:0.1", "tolerance:x", "zip", 5):
        with pytest.raises(ConfigError, match="kv_compression"):
            Compression.parse(bad)


@pytest.mark.parametrize("bits,bound", [(8, 0.01), (4, 0.2), (2, 0.9)])
def test_quantize_round_trip(bits, bound):
    x = np.random.default_rng(bits).standard_normal((3, 2, 2, 16, 64)).astype(np.float32)
    # one group: the error is at most half a step (range / levels / 2) plus float16 rounding
    codes, scale, bias = quantize(x, bits, 32)
    y = dequantize(codes, scale, bias, bits, 32)
    g = x.reshape(-1, 32)
    step = (g.max(1) - g.min(1)) / ((1 << bits) - 1)
    err = np.abs(x - y).reshape(-1, 32).max(1)
    assert (err <= step / 2 + 2e-3 * np.abs(g).max(1) + 1e-6).all()
    # a chunk: keys per channel over the 16 tokens, values per token
    blob = encode(x, bits)
    assert len(blob) == packed_bytes(x.shape, bits)
    z = decode(np.frombuffer(blob, np.uint8), x.shape, bits)
    kg = x[:, 0].swapaxes(-1, -2).reshape(-1, 16)
    kerr = np.abs(x[:, 0] - z[:, 0]).swapaxes(-1, -2).reshape(-1, 16).max(1)
    assert (kerr <= (kg.max(1) - kg.min(1)) / ((1 << bits) - 1) / 2 + 2e-3 * np.abs(kg).max(1) + 1e-6).all()
    assert np.abs(x - z).max() < bound * np.abs(x).max()
    assert np.array_equal(lossy(x, bits), z)


def _dequantize_ref(codes, scale, bias, bits, group):
    """Plain reading: value j of a byte at bits * j, then code * scale + bias per group."""
    per = 8 // bits
    c = np.stack([(codes >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], axis=-1)
    c = c.reshape(*codes.shape[:-1], -1, group).astype(np.float32)
    return (c * scale.astype(np.float32)[..., None] + bias.astype(np.float32)[..., None]).reshape(*codes.shape[:-1], -1)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantize_into_a_view_equals_the_plain_reading(bits):
    """dequantize writes into `out` (a transposed chunk's keys land in place, a strided view of a
    chunk's values too) the very floats the plain reading gives."""
    x = np.random.default_rng(bits).standard_normal((2, 3, 64, 16)).astype(np.float32)
    codes, scale, bias = quantize(x, bits, 16)
    want = _dequantize_ref(codes, scale, bias, bits, 16)
    assert np.array_equal(dequantize(codes, scale, bias, bits, 16), want)
    out = np.full((2, 3, 16, 64), np.nan, np.float32)
    dequantize(codes, scale, bias, bits, 16, out=out.swapaxes(-1, -2))
    assert np.array_equal(out.swapaxes(-1, -2), want)
    v = np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)
    vc, vs, vb = quantize(v, bits, 32)
    strided = np.empty((2, 64, 16), np.float32)
    dequantize(vc, vs, vb, bits, 32, out=strided.swapaxes(-1, -2))
    assert np.array_equal(strided.swapaxes(-1, -2), _dequantize_ref(vc, vs, vb, bits, 32))
    with pytest.raises(ValueError, match="float32"):
        dequantize(vc, vs, vb, bits, 32, out=np.empty((2, 16, 64), np.float64))


def test_widths_meet_the_budget_and_minimise_weighted_error():
    rng = np.random.default_rng(0)
    d = rng.random(12) ** 3
    err = np.sort(rng.random((12, 3)), axis=1) * [1, 20, 300]  # error grows as the width falls
    w = assign_widths(d, err, 4 * 12)
    assert sum(w) <= 48 and set(w) <= {2, 4, 8}
    cost = lambda ws: sum(d[i] * err[i, {8: 0, 4: 1, 2: 2}[x]] for i, x in enumerate(ws))  # noqa: E731
    # exact: no single chunk's width change within the budget lowers the cost
    for i in range(12):
        for x in (2, 4, 8):
            alt = list(w)
            alt[i] = x
            if sum(alt) <= 48:
                assert cost(alt) >= cost(w) - 1e-12
    # a chunk no query attends costs nothing at any width: it gets the fewest bits
    d2 = d.copy()
    d2[3] = 0.0
    assert assign_widths(d2, err, 48)[3] == 2
    assert assign_widths(d, err, 10) == [2] * 12  # below 2 bits each: all at 2
    assert assign_widths(d, err, 1000) == [8] * 12
    assert assign_widths(d[:1], err[:1], 4) == [4] and assign_widths(d[:1], err[:1], 2) == [2]  # budgets below 8 bits


def test_tolerance_widths_average_at_most_the_ratio():
    c = Compression.parse("tolerance:0.5")
    rng = np.random.default_rng(1)
    fresh = {i: rng.standard_normal((2, 2, 1, 16, 32)).astype(np.float32) * (1 + i) for i in range(3, 9)}
    got = choose_widths(c, rng.random(9), {0: 8, 1: 8, 2: 4}, fresh)
    assert set(got) == set(fresh) and (sum(got.values()) + 20) / 9 <= 4 + 1e-9


def test_density_tracker_counts_rows_causally():
    t = DensityTracker()
    t.add(np.array([3.0, 2.0, 1.0]), n_queries=3, heads=1)  # a 3-token prefill: token j seen by 3 - j queries
    assert t.rows.tolist() == [3, 2, 1]
    t.add(np.array([0.5, 0.25, 0.25, 1.0]), n_queries=1, heads=1)  # one decode query sees all four
    assert t.rows.tolist() == [4, 3, 2, 1]
    d = t.chunk_density(2, 2)
    assert np.allclose(d, [np.mean([3.5 / 4, 2.25 / 3]), np.mean([1.25 / 2, 1.0])])


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("T", [1, 5])
def test_attention_columns_matches_reference(backend, T):
    ops = get_backend(backend)
    rng = np.random.default_rng(T)
    q = rng.standard_normal((1, 6, T, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 9, 16)).astype(np.float32)
    got = ops.to_numpy(ops.attention_columns(ops.array(q), ops.array(k), 0.25))
    ref = attention_columns_ref(q, k, 0.25)
    assert got.shape == (9,)
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert np.isclose(got.sum(), 6 * T, rtol=1e-5)  # every query's row sums to 1


@pytest.mark.parametrize("width", [0, 8, 4, 2])
def test_swap_file_round_trip_at_each_width(tmp_path, width):
    shape = ChunkShape(2, 2, 64, 16)
    x = np.random.default_rng(width).standard_normal(shape.array_shape).astype(np.float32)
    swap = SwapDir(str(tmp_path))
    crc = swap.write_chunk("abcdefgh12", 3, shape, 16, x, width)
    raw = np.fromfile(swap.chunk_path("abcdefgh12", 3), np.uint8)
    assert raw.size == file_bytes(shape, width) and raw.size % 4096 == 0  # whole blocks, for direct reads
    header, payload = bytes(raw[:4096]), raw[4096 : 4096 + payload_bytes(shape, width)]
    assert swap.chunk_problem("f", header, payload, shape, 16, width, crc) is None
    y = chunk_data(payload, shape, width)
    assert np.array_equal(y, x if width == 0 else lossy(x, width))
    assert "not the chunk" in swap.chunk_problem("f", header, payload, shape, 15, width, crc)
    if width:
        assert "not the chunk" in swap.chunk_problem(
            "f", header, payload, shape, 16, 8 if width != 8 else 4, crc
        ) or "another shape" in swap.chunk_problem("f", header, payload, shape, 16, 8 if width != 8 else 4, crc)
    bad = payload.copy()
    bad[bad.size // 2] ^= 0xFF
    assert "checksum" in swap.chunk_problem("f", header, bad, shape, 16, width, crc)
