"""Cost model: its read count and bytes for a set of rows are what the reader pool really issues,
and its I/O time follows the disk profile."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.sparse import cost_model

PROFILE = {"throughput": {"1": {"4096": 4e7, "1048576": 1e9}, "4": {"4096": 1e8, "1048576": 2e9}},
           "latency_s": 1e-4}


def test_throughput_interpolates_log_log_and_clamps():
    assert cost_model.throughput(PROFILE, 4096, 1) == pytest.approx(4e7)
    assert cost_model.throughput(PROFILE, 1 << 30, 4) == pytest.approx(2e9)
    mid = cost_model.throughput(PROFILE, 65536, 4)  # halfway in log2 between 4 KiB and 1 MiB
    assert mid == pytest.approx(2 ** ((np.log2(1e8) + np.log2(2e9)) / 2))


def test_io_seconds_adds_latency_per_batch():
    t = cost_model.io_seconds(PROFILE, 1 << 20, 1, 3, 4)
    assert t == pytest.approx(3e-4 + (1 << 20) / 2e9)


@pytest.mark.parametrize("mode,fields", [("all", 1), ("window", None)])
def test_reads_match_what_the_pool_issues(tiny_store, mode, fields):
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend="torch", ffn="sparse", sparse_mode=mode, memory_budget="100%",
                        predictor="dense", io_mode="buffered", progress=False) as e:
        src = e.ffn
        lay = src.layout
        nf = len(lay.fields) if fields is None else fields
        rng = np.random.default_rng(0)
        for _ in range(5):
            rows = np.sort(rng.choice(lay.n_neurons, 40, replace=False))
            dest = np.zeros((rows.size, lay.bundle_bytes), np.uint8)
            b0, r0 = src.bytes_read, src.reads
            src._read_rows(1, rows, dest, np.arange(rows.size), np.zeros(0, np.int64), dest[:0])
            if nf == 1:
                assert (src.reads - r0, src.bytes_read - b0) == cost_model.ranges_to_reads(
                    rows * lay.bundle_bytes, np.full(rows.size, lay.bundle_bytes), src.pool.coalesce_gap)
            else:  # unbundled: one range per field, in each field's own matrix
                offs = np.concatenate([base + rows * f.nbytes for f, base in zip(lay.fields, src.field_offsets[1])])
                lens = np.concatenate([np.full(rows.size, f.nbytes) for f in lay.fields])
                assert (src.reads - r0, src.bytes_read - b0) == cost_model.ranges_to_reads(
                    offs, lens, src.pool.coalesce_gap)
