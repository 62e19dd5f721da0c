"""Cost model: its read count and bytes for a set of rows are what the reader pool really issues,
and its I/O time follows the disk profile."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.sparse import cost_model

PROFILE = {"throughput": {"1": {"4096": 4e7, "1048576": 1e9}, "4": {"4096": 1e8, "1048576": 2e9}}, "latency_s": 1e-4}


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
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="160%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode=mode, predictor="dense"),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        src = e.ffn
        lay = src.layout
        nf = len(lay.fields) if fields is None else fields
        rng = np.random.default_rng(0)
        for _ in range(5):
            rows = np.sort(rng.choice(lay.n_neurons, 40, replace=False))
            dest = np.zeros((rows.size, lay.bundle_bytes), np.uint8)
            s0 = src.stats()
            src._read(1, [(rows, dest, np.arange(rows.size))])
            s1 = src.stats()
            got = (s1.reads - s0.reads, s1.bytes_read - s0.bytes_read)
            if nf == 1:
                assert got == cost_model.ranges_to_reads(
                    rows * lay.bundle_bytes, np.full(rows.size, lay.bundle_bytes), src.pool.coalesce_gap
                )
            else:  # unbundled: one range per field, in each field's own matrix
                offs = np.concatenate([base + rows * f.nbytes for f, base in zip(lay.fields, src.rows.offsets[1])])
                lens = np.concatenate([np.full(rows.size, f.nbytes) for f in lay.fields])
                assert got == cost_model.ranges_to_reads(offs, lens, src.pool.coalesce_gap)


def test_window_activity_matches_a_brute_force_count():
    from mlx_flash.calibrate.activations import window_activity

    rng = np.random.default_rng(1)
    mags = [rng.random((40, 12)).astype(np.float16) for _ in range(2)]
    th = [0.6, 0.3]
    got = window_activity(mags, th, context=20, kmax=3)
    for k in (1, 2, 3):
        union, new = [], []
        for m, t in zip(mags, th):
            for s in (0, 20):
                A = m[s : s + 20].astype(np.float32) > t
                for p in range(3, 20):  # positions with kmax tokens before them
                    before = A[p - k : p].any(0)
                    union.append((A[p] | A[p - k + 1 : p].any(0)).mean() if k > 1 else A[p].mean())
                    new.append((A[p] & ~before).mean())
        assert got["union"][k - 1] == pytest.approx(np.mean(union))
        assert got["new"][k - 1] == pytest.approx(np.mean(new))


def test_planner_picks_the_cheapest_window_that_fits():
    from mlx_flash.sparse.planner import choose_window

    activity = {"union": [0.2, 0.3, 0.4, 0.5], "new": [0.1, 0.05, 0.03, 0.02]}
    k, table = choose_window(activity, capacity=35, n_rows=100, n_layers=4, row_bytes=4096, profile=PROFILE, threads=4)
    assert k == 2 and [r["window"] for r in table] == [1, 2]  # a window of 3 would cache 40 > 35 rows
    assert table[1]["predicted_io_ms"] < table[0]["predicted_io_ms"]
    k, table = choose_window(activity, capacity=10, n_rows=100, n_layers=4, row_bytes=4096, profile=PROFILE, threads=4)
    assert k == 1 and table[0]["rows_read"] == 10  # half of one token's 20 rows overflow every token


def test_planner_sizes_the_window_of_a_real_load(tiny_store):
    from mlx_flash.sparse.planner import DEFAULT_WINDOW

    store, _ = tiny_store("llama")
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="160%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="all", predictor="dense"),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        # no activity measured: the default window
        assert e.ffn.plan.window == DEFAULT_WINDOW and mlx_flash.memory_plan(e)["window"] == DEFAULT_WINDOW
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="160%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="all", predictor="dense", window=2),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        assert e.ffn.plan.window == 2


def test_budget_counts_weights_as_the_backend_holds_them(tiny_store):
    store, _ = tiny_store("llama", precision="q4")
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="sparse",
        weights_budget="160%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="naive"),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        a, lay = mlx_flash.memory_plan(e), e.ffn.layout
        assert a["resident_weights"] == e.ops.held_bytes(e.weights)
        assert a["converted_layer"] == lay.layer_nbytes  # held as stored: the CPU kernel computes on those bytes
        assert a["model_bytes"] == a["resident_weights"] + len(lay.layer_offsets) * a["converted_layer"]
        assert a["planned_total"] <= a["budget"]
