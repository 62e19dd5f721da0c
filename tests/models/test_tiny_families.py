"""Every supported family, built tiny and random from its real config shape, matches transformers'
implementation on both backends, with FFN from resident weights and from the bundle file."""

import numpy as np
import pytest

import mlx_flash
import tiny_models

torch = pytest.importorskip("torch")

FAMILIES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("opt", {}),
    ("opt", {"do_layer_norm_before": False}),
]


@pytest.mark.parametrize("family,over", FAMILIES, ids=[f"{f}-{'-'.join(o) or 'base'}" for f, o in FAMILIES])
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_logits_match_transformers(tiny_store, family, over, backend):
    store, hf = tiny_store(family, **over)
    ids = tiny_models.random_ids(40)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    outs = {}
    for ffn in ("resident", "stream"):
        with mlx_flash.load(store, backend=backend, ffn=ffn) as e:
            full = e.logits(ids)
            caches = e.new_caches()
            e.prefill(ids[:20], caches)
            incremental = np.stack([e.forward([t], caches)[-1] for t in ids[20:]])
        assert np.abs(full - ref).max() < 1e-4, f"{ffn}: prefill logits differ from transformers"
        assert np.abs(incremental - ref[20:]).max() < 1e-4, f"{ffn}: decode with KV cache differs"
        outs[ffn] = full
    # Resident and streamed FFN decode the same bytes through the same ops: bit-identical.
    assert np.array_equal(outs["resident"], outs["stream"])


@pytest.mark.parametrize("precision,tol", [("f16", 2e-2), ("q8", 5e-2)])
def test_ffn_precisions_stay_close(tiny_store, precision, tol):
    """Lossy FFN storage options change logits by a bounded amount (and stream == resident)."""
    store, hf = tiny_store("llama", precision=precision)
    ids = tiny_models.random_ids(32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    for backend in ("mlx", "torch"):
        with mlx_flash.load(store, backend=backend) as a, mlx_flash.load(store, backend=backend, ffn="stream") as b:
            la, lb = a.logits(ids), b.logits(ids)
        assert np.array_equal(la, lb)
        assert np.abs(la - ref).max() < tol


def test_bf16_checkpoint(tiny_store):
    """bfloat16 tensors travel as raw 16-bit words and come back exactly."""
    store, hf = tiny_store("llama", dtype="bfloat16")
    ids = tiny_models.random_ids(24)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()  # float32 copy of the bfloat16 weights
    for backend in ("mlx", "torch"):
        with mlx_flash.load(store, backend=backend) as e:
            # 1e-3, not 1e-4: the reference's RoPE frequencies went through bfloat16 with the weights.
            assert np.abs(e.logits(ids) - ref).max() < 1e-3
