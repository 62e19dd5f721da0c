"""Gemma 3 (text) built tiny and random from its real config shape (five sliding-window layers with a
window of 8 and one full-attention layer, QK norm, GeGLU, scaled tied embeddings, two RoPE bases)
matches transformers' implementation on both backends, past the window, prefilled and step by step."""

import numpy as np
import pytest

import mlx_flash
import tiny_models

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    "over", [{}, {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}], ids=["base", "linear-scaled-full-layers"]
)
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_logits_match_transformers(tiny_store, backend, over):
    store, hf = tiny_store("gemma3_text", **over)
    ids = tiny_models.random_ids(48, seed=4)  # six windows of 8
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    for ffn in ("resident", "stream"):
        with mlx_flash.load(store, backend=backend, ffn=ffn, progress=False) as e:
            full = e.logits(ids)
            caches = e.new_caches()
            e.prefill(ids[:20], caches)
            step = np.stack([e.forward([t], caches)[-1] for t in ids[20:]])
        assert np.abs(full - ref).max() < 1e-4, ffn
        assert np.abs(step - ref[20:]).max() < 1e-4, ffn


def test_the_window_matters(tiny_store):
    """Without its window (every layer full attention) the same weights answer otherwise past 8 tokens."""
    store, hf = tiny_store("gemma3_text")
    ids = tiny_models.random_ids(40, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    tiny_models.edit_manifest(store, lambda m: m["config"].__setitem__("window", 10_000))
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        wide = e.logits(ids)
    assert np.abs(wide[:8] - ref[:8]).max() < 1e-4
    assert np.abs(wide[8:] - ref[8:]).max() > 1e-3
