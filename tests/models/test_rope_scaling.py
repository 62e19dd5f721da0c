"""RoPE scalings of real configs (Llama 3.1's "llama3", Qwen's "yarn"): tiny random models built with
those scalings match transformers' logits to 1e-4 at positions well past the original context, on
both backends; the frequencies against a direct transcription of the definitions."""

import math

import numpy as np
import pytest

import mlx_flash
import tiny_models
from mlx_flash.errors import UnsupportedModelError
from mlx_flash.models.llama import normalize_config
from mlx_flash.models.rope import llama3_inverse_frequencies, rope_frequencies, yarn_inverse_frequencies

torch = pytest.importorskip("torch")

ORIGINAL = 32  # the tiny models' "original" context; the test runs 160 tokens, 5x past it
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
}  # Llama 3.1's values, its context scaled down
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}  # Qwen2.5's form
CASES = [("llama", LLAMA3), ("qwen2", YARN), ("llama", {**YARN, "beta_fast": 16, "beta_slow": 2})]


@pytest.mark.parametrize("family,scaling", CASES, ids=["llama3", "yarn-qwen2", "yarn-betas"])
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_logits_match_transformers_past_the_original_context(tiny_store, family, scaling, backend):
    store, hf = tiny_store(family, rope_scaling=dict(scaling), max_position_embeddings=256, rope_theta=10000.0)
    ids = tiny_models.random_ids(160, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    with mlx_flash.load(store, backend=backend, progress=False) as e:
        full = e.logits(ids)
        caches = e.new_caches()
        e.prefill(ids[:100], caches)
        step = np.stack([e.forward([t], caches)[-1] for t in ids[100:]])
    assert np.abs(full - ref).max() < 1e-4
    assert np.abs(step - ref[100:]).max() < 1e-4
    # the same weights without the scaling answer otherwise past the original context: it was applied
    tiny_models.edit_manifest(store, lambda m: m["config"].pop("rope_scaling"))
    with mlx_flash.load(store, backend=backend, progress=False) as e:
        unscaled = e.logits(ids)
    assert np.abs(unscaled[ORIGINAL:] - ref[ORIGINAL:]).max() > 1e-2


def test_llama3_frequencies_follow_the_definition():
    dims, base = 64, 500000.0
    inv = llama3_inverse_frequencies(dims, base, {**LLAMA3, "original_max_position_embeddings": 8192})
    for i, f in enumerate(1.0 / base ** (np.arange(0, dims, 2) / dims)):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            want = f
        elif wavelen > 8192 / 1:
            want = f / 8
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            want = (1 - smooth) * f / 8 + smooth * f
        assert inv[i] == pytest.approx(want, rel=1e-12)


def test_yarn_attention_factor_and_ends():
    inv, factor = yarn_inverse_frequencies(64, 10000.0, YARN, 256)
    assert factor == pytest.approx(0.1 * math.log(4) + 1)
    plain = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    assert inv[0] == pytest.approx(plain[0])  # fastest pairs extrapolated (kept)
    assert inv[-1] == pytest.approx(plain[-1] / 4)  # slowest interpolated (slowed by the factor)
    assert rope_frequencies(64, 10000.0, None, 256) == (None, 1.0)
    _, f2 = rope_frequencies(64, 10000.0, {**YARN, "attention_factor": 1.5}, 256)
    assert f2 == 1.5


@pytest.mark.parametrize(
    "scaling,words",
    [
        ({"rope_type": "longrope", "factor": 2}, "'longrope' is not supported"),
        ({"rope_type": "llama3", "factor": 8}, "lacks or mangles"),
    ],
)
def test_unsupported_or_incomplete_scalings_are_one_line(scaling, words):
    hf = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 96,
        "rope_scaling": scaling,
    }
    with pytest.raises(UnsupportedModelError, match=words):
        normalize_config(hf, "config.json")
