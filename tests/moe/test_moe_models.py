"""MoE graphs (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with norm_topk_prob, OLMoE with
full-width q/k norms) against transformers on tiny random models, both backends; streamed experts
under a budget give the resident model's greedy tokens and logits bit for bit; bad checkpoints and
budgets get one named error."""

import numpy as np
import pytest

import mlx_flash
import tiny_models
from greedy import greedy
from mlx_flash.errors import ConfigError, ModelFileError

FAMILIES = tiny_models.MOE_FAMILIES


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_store, family, backend):
    import torch

    store, hf = tiny_store(family)
    ids = tiny_models.random_ids(12)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    with mlx_flash.load(store, backend=backend, progress=False) as e:
        got = np.asarray(e.forward(ids, e.new_caches(), all_logits=True)).reshape(want.shape)
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_experts_equal_resident_at_every_budget(tiny_store, family):
    store, _ = tiny_store(family)
    prompt = tiny_models.random_ids(10, seed=3)
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        want = greedy(e, prompt, 64)
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="stream",
        weights_budget="1GB",
        progress=False,
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        a = mlx_flash.memory_plan(e)
    fixed = a["resident_weights"]
    for share in (0.1, 0.5, 1.0):
        budget = fixed + max(a["slot_bytes"], int(share * a["all_experts_bytes"]))
        with mlx_flash.load(
            store,
            backend="torch",
            ffn="stream",
            weights_budget=budget,
            progress=False,
            io=mlx_flash.IOOptions(mode="buffered"),
        ) as e:
            got = greedy(e, prompt, 64)
            hits, misses = map(sum, zip(*e.ffn.hit_stats()))
            slots = e.ffn.cache.slots
        assert got[0] == want[0], f"{family} at {share:.0%} of expert bytes"
        assert np.array_equal(got[1], want[1])
        assert slots <= max(1, int(share * a["all_experts_bytes"]) // a["slot_bytes"])
        if share == 1.0:  # everything fits: each expert is read once
            assert misses <= a["all_experts_bytes"] // a["slot_bytes"]
        else:
            assert misses > 0 and hits + misses > 0


def test_streamed_mlx_equals_resident_mlx(tiny_store):
    store, _ = tiny_store("qwen2_moe")
    prompt = tiny_models.random_ids(10, seed=4)
    with mlx_flash.load(store, backend="mlx", progress=False) as e:
        want = greedy(e, prompt, 16)
    with mlx_flash.load(
        store,
        backend="mlx",
        ffn="stream",
        weights_budget="90%",
        progress=False,
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        got = greedy(e, prompt, 16)
        assert e.ffn.cache.slots < 8  # fewer slots than the model's 2 x 4 experts: some are re-read
    assert got[0] == want[0] and np.array_equal(got[1], want[1])


def test_expert_count_disagreeing_with_config_is_named(tmp_path):
    from mlx_flash.convert import convert

    tiny_models.build("mixtral", str(tmp_path / "hf"))
    tiny_models.edit_config(tmp_path / "hf", num_local_experts=8)
    with pytest.raises(
        ModelFileError, match="layer 0 has 4 experts and a router over 4, but the config says num_experts=8"
    ):
        convert(str(tmp_path / "hf"), str(tmp_path / "st"), progress=False)
    assert not (tmp_path / "st").exists()


def test_budget_below_the_minimum_is_refused(tiny_store):
    store, _ = tiny_store("olmoe")
    with pytest.raises(
        ConfigError, match=r"weights budget 0\.0 MB .*below the minimum .* for this MoE model \(non-expert weights"
    ):
        mlx_flash.load(store, backend="torch", ffn="stream", weights_budget="10KB", progress=False)


def test_unknown_policy_is_named(tiny_store):
    store, _ = tiny_store("olmoe")
    with pytest.raises(ConfigError, match="expert_policy 'mru' is unknown"):
        mlx_flash.load(
            store, backend="torch", ffn="stream", progress=False, experts=mlx_flash.ExpertOptions(policy="mru")
        )


def test_chat_stats_report_the_expert_cache(tiny_store):
    from mlx_flash.cli.chat import format_stats

    store, _ = tiny_store("mixtral")
    with mlx_flash.load(
        store,
        backend="torch",
        ffn="stream",
        weights_budget="90%",
        progress=False,
        experts=mlx_flash.ExpertOptions(policy="lru"),
        io=mlx_flash.IOOptions(mode="buffered"),
    ) as e:
        e.generate("w1 w2 w3", max_tokens=4)
        text = format_stats(e)
    assert "expert cache (LRU" in text and "routed experts" in text
