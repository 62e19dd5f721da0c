"""Expert-wise bit-widths: a store with each expert at its own width decodes each expert as the
fake-quantized reference computes it, streams exactly like its resident self, and the width search
keeps the perplexity within its limit."""

import numpy as np
import pytest

import mlx_flash
import tiny_models
from greedy import greedy
from mlx_flash.errors import ConfigError
from mlx_flash.calibrate.expert_bits import ExpertSwapper, assign_widths, importance, perplexity_at, uniform_widths
from mlx_flash.calibrate.mixed_store import expert_rows, write_expert_store
from mlx_flash.store import open_store

MIX = [[2, 4, 8, 16], [16, 8, 4, 2]]  # 2 layers x 4 experts


@pytest.fixture
def f16_moe(tiny_store):
    store, _ = tiny_store("qwen3_moe", precision="f16")
    return store


def logits(path, ids, **kw):
    with mlx_flash.load(path, backend="torch", progress=False, **kw) as e:
        return np.asarray(e.forward(ids, e.new_caches(), all_logits=True))


def test_all_float16_copy_is_the_same_model(f16_moe, tmp_path):
    out = write_expert_store(open_store(f16_moe), str(tmp_path / "copy"), [[16] * 4] * 2, progress=False)
    ids = tiny_models.random_ids(12)
    assert np.array_equal(logits(out, ids), logits(f16_moe, ids))


def test_mixed_widths_decode_like_the_fake_quantized_reference(f16_moe, tmp_path):
    src = open_store(f16_moe)
    out = write_expert_store(src, str(tmp_path / "mix"), MIX, progress=False)
    st = open_store(out)
    lay = st.manifest.ffn
    assert lay.precision == "mixed" and len(lay.expert_formats) == 4
    assert lay.expert_size(0, 0) < lay.expert_size(0, 1) < lay.expert_size(0, 2) < lay.expert_size(0, 3)
    ids = tiny_models.random_ids(12, seed=1)
    with mlx_flash.load(f16_moe, backend="torch", progress=False) as e:
        ExpertSwapper(e, [[expert_rows(src, i, x) for x in range(4)] for i in range(2)]).set(MIX)
        want = np.asarray(e.forward(ids, e.new_caches(), all_logits=True))
    assert np.abs(logits(out, ids) - want).max() < 1e-4


def test_mixed_store_streams_exactly(f16_moe, tmp_path):
    out = write_expert_store(open_store(f16_moe), str(tmp_path / "mix"), MIX, progress=False)
    prompt = tiny_models.random_ids(6, seed=2)

    def run(**kw):
        with mlx_flash.load(out, backend="torch", progress=False, **kw) as e:
            return greedy(e, prompt, 32)

    want = run()
    with mlx_flash.load(out, backend="torch", ffn="stream", weights_budget="1GB", progress=False) as e:
        a = mlx_flash.memory_plan(e)
    budget = a["resident_weights"] + 3 * a["slot_bytes"]
    got = run(ffn="stream", weights_budget=budget, io=mlx_flash.IOOptions(mode="buffered"))
    assert got[0] == want[0] and np.array_equal(got[1], want[1])


def test_bad_widths_and_quantized_sources_are_refused(f16_moe, tiny_store, tmp_path):
    with pytest.raises(ConfigError, match="bit-widths must be 2 layers x 4 experts"):
        write_expert_store(open_store(f16_moe), str(tmp_path / "x"), [[3] * 4] * 2, progress=False)
    q4, _ = tiny_store("mixtral", precision="q4")
    with pytest.raises(ConfigError, match="start from a store with float experts"):
        write_expert_store(open_store(q4), str(tmp_path / "y"), [[4] * 4] * 2, progress=False)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_width_search_meets_its_limit(f16_moe):
    src = open_store(f16_moe)
    ids = tiny_models.random_ids(96, seed=4)
    with mlx_flash.load(f16_moe, backend="torch", progress=False) as e:
        sw = ExpertSwapper(e, [[expert_rows(src, i, x) for x in range(4)] for i in range(2)])
        widths = uniform_widths(sw, ids, 0.001)
        assert widths["uniform"][2] >= widths["uniform"][8] * 0.99  # narrower is no better, near enough
        widths.update(low=2, high=8)  # force a search between two widths
        imp = importance(sw, ids, 2, 8)
        assert imp.shape == (2, 4)
        got = assign_widths(sw, ids, imp, widths, log=None)
        assert perplexity_at(sw, ids, got["bits"]) <= widths["limit"]
        assert sum(b == 2 for r in got["bits"] for b in r) == got["k"]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_affine_quantize_packs_as_mlx_and_keeps_values_already_on_a_grid(bits):
    import mlx.core as mx

    from mlx_flash.calibrate.mixed_store import affine_dequantize, affine_quantize

    rng = np.random.default_rng(bits)
    w = rng.standard_normal((6, 64)).astype(np.float32)
    q = affine_quantize(w, bits, 32)
    w32, s32, b32 = mx.array(q[0]), mx.array(q[1]).astype(mx.float32), mx.array(q[2]).astype(mx.float32)
    ref = np.array(mx.dequantize(w32, s32, b32, group_size=32, bits=bits))
    got = affine_dequantize(*q, bits, 32)
    assert np.abs(ref - got).max() < 1e-6  # MLX reads our packing as we do
    step = (w.max() - w.min()) / (2**bits - 1)
    assert np.abs(got - w).max() < step  # within a step of the weights (half a step, plus float16 scales)
    # weights that already sit on a min..max grid (a dequantized 4-bit source) come back unchanged
    codes = rng.integers(0, 2**bits, (6, 64))
    codes[:, ::32], codes[:, 1::32] = 0, 2**bits - 1
    grid = (codes * 2.0**-7 - 2.0**-4).astype(np.float32)  # exact in float16, as a 4-bit source dequantized is
    assert np.abs(affine_dequantize(*affine_quantize(grid, bits, 32), bits, 32) - grid).max() < 1e-4
