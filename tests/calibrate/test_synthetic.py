"""Synthetic stores and the I/O-only replay: a small store of a made-up shape validates like a real
one, the statistical activity fires the asked share of neurons, and a replay reads exactly the
rows the cache lacks (cache rows equal the file's bundle rows)."""

import numpy as np
import pytest

from mlx_flash.calibrate import synthetic
from mlx_flash.calibrate.io_replay import replay
from mlx_flash.sparse.build import replay_source
from mlx_flash.sparse.modes import SparseMode, SparsePlan
from mlx_flash.store import open_store
from mlx_flash.store.reader_pool import ReaderPool

PROFILE = {"throughput": {"2": {"4096": 1e8, "1048576": 1e9}}, "latency_s": 1e-4}


@pytest.fixture
def small_shape(monkeypatch):
    shape = dict(
        synthetic.SHAPES["llama-2-7b"],
        hidden_size=64,
        intermediate_size=200,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        vocab_size=50,
    )
    monkeypatch.setitem(synthetic.SHAPES, "small", shape)
    return "small"


def test_store_validates_and_replay_reads_the_missing_rows(tmp_path, small_shape):
    path = synthetic.make_synthetic_store(str(tmp_path / "syn"), small_shape)
    store = open_store(path, verify_checksums=True)
    lay = store.manifest.ffn
    assert (lay.n_neurons, lay.d_model, len(lay.layer_offsets)) == (200, 64, 3)
    activity = synthetic.StatisticalActivity(3, 200, active=0.05, seed=1)
    src = replay_source(
        store, ReaderPool(threads=2, mode="buffered"), SparsePlan(SparseMode.ALL, capacity=60, window=4)
    )
    try:
        steps = replay(src, activity, 20, PROFILE)
        blob = np.fromfile(store.file_path(lay.file), dtype=np.uint8)
        for i, c in enumerate(src.caches):
            base = lay.layer_offsets[i]
            want = blob[base : base + lay.layer_nbytes].reshape(200, lay.bundle_bytes)[c.live_ids()]
            assert np.array_equal(c.live_rows(), want)
            assert c.num_used <= 60
        assert all(s["bytes"] > 0 and s["model_io_ms"] > 0 for s in steps)
        assert steps[-1]["rows_loaded"] < 3 * 10  # the window keeps most rows: only new ones are read
    finally:
        src.close()


def test_moe_shape_store_validates_with_routers_and_qk_norms(tmp_path, monkeypatch):
    shape = dict(
        synthetic.SHAPES["qwen3-30b-a3b"],
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=4 * 32,
        vocab_size=50,
    )
    monkeypatch.setitem(synthetic.SHAPES, "small-moe", shape)
    store = open_store(synthetic.make_synthetic_store(str(tmp_path / "syn"), "small-moe"), verify_checksums=True)
    lay = store.manifest.ffn
    assert (lay.n_experts, lay.expert_neurons, lay.d_model) == (4, 32, 64)
    assert store.manifest.tensors["model.layers.1.mlp.gate.weight"].shape == [4, 64]
    assert store.manifest.tensors["model.layers.1.self_attn.q_norm.weight"].shape == [32]
    assert store.manifest.tensors["model.layers.1.self_attn.q_proj.weight"].shape == [128, 64]


def test_statistical_activity_fires_the_asked_share():
    a = synthetic.StatisticalActivity(2, 1000, active=0.03, persist=0.5, seed=0)
    sets = [np.flatnonzero(a.active(0)[0]) for _ in range(50)]
    assert all(s.size == 30 for s in sets)
    overlap = np.mean([np.intersect1d(x, y).size / 30 for x, y in zip(sets, sets[1:])])
    assert overlap >= 0.4  # tokens share neurons, which is what the window exploits


def test_unknown_shape_is_named(tmp_path):
    with pytest.raises(Exception, match="synthetic shape 'gpt-9' is unknown"):
        synthetic.make_synthetic_store(str(tmp_path / "x"), "gpt-9")
