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


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_whole_expert_formats_compute_in_place_so_a_miss_builds_no_weights(f16_moe, tmp_path, monkeypatch, backend):
    """The quantized formats (down kept as the [D, Fe] matrix, D = 2 Fe here: two rows a bundle) are
    multiplied where the read put them; a slot's weights, built once, serve every later expert of
    their format read there (float16 experts are converted per read, as before). Tokens and logits
    equal the resident model's."""
    from mlx_flash.moe import experts as experts_mod
    from mlx_flash.weights import in_place

    out = write_expert_store(open_store(f16_moe), str(tmp_path / "mix"), MIX, progress=False)
    builds = {True: 0, False: 0}
    real = experts_mod.expert_weights

    def counted(ops, layout, layer, expert, buf):
        builds[in_place(ops, layout.expert_layout(layer, expert))] += 1
        return real(ops, layout, layer, expert, buf)

    prompt = tiny_models.random_ids(6, seed=3)
    with mlx_flash.load(out, backend=backend, progress=False) as e:
        want = greedy(e, prompt, 32)
        formats = e.store.manifest.ffn.expert_formats
        assert [in_place(e.ops, e.store.manifest.ffn.expert_layout(0, x)) for x in range(4)] == [
            True,
            True,
            True,
            False,
        ]
        assert [f.precision for f in formats] == ["q2", "q4", "q8", "f16"]
    with mlx_flash.load(out, backend=backend, ffn="stream", weights_budget="1GB", progress=False) as e:
        a = mlx_flash.memory_plan(e)
    monkeypatch.setattr(experts_mod, "expert_weights", counted)
    slots = 3
    kw = dict(ffn="stream", weights_budget=a["resident_weights"] + slots * a["slot_bytes"], progress=False)
    with mlx_flash.load(out, backend=backend, io=mlx_flash.IOOptions(mode="buffered"), **kw) as e:
        got = greedy(e, prompt, 32)
        misses = sum(m for _, m in e.ffn.stats().expert_hits)
    assert got[0] == want[0] and np.array_equal(got[1], want[1])
    assert builds[True] <= slots * 3 < misses, (builds, misses)  # at most once per slot and in-place format


def test_a_format_whose_rows_straddle_bundles_is_converted_and_streams_exactly(tiny_store, tmp_path):
    """D = 64 is not a multiple of Fe = 96: a bundle's piece of down holds two thirds of a row, so the
    expert is converted for compute as before, with the same tokens streamed as resident."""
    from mlx_flash.weights import down_rows_per_bundle, in_place

    store, _ = tiny_store("qwen3_moe", precision="f16", moe_intermediate_size=96)
    out = write_expert_store(open_store(store), str(tmp_path / "mix"), [[4] * 4] * 2, progress=False)
    prompt = tiny_models.random_ids(6, seed=4)
    with mlx_flash.load(out, backend="torch", progress=False) as e:
        lay = e.store.manifest.ffn.expert_layout(0, 0)
        assert lay.down_rows and down_rows_per_bundle(lay) == 0 and not in_place(e.ops, lay)
        want = greedy(e, prompt, 16)
    with mlx_flash.load(out, backend="torch", ffn="stream", weights_budget="1GB", progress=False) as e:
        a = mlx_flash.memory_plan(e)
    budget = a["resident_weights"] + 3 * a["slot_bytes"]
    with mlx_flash.load(out, backend="torch", ffn="stream", weights_budget=budget, progress=False) as e:
        got = greedy(e, prompt, 16)
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
