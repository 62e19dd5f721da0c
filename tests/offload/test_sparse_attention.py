"""Top-k sparse attention: each backend's ops.top_k_mask against the numpy reference (causal, padded
batch and unmasked), the reference against a per-query loop, and the TopKAttention wrapper in a tiny
model: keep 1.0 changes nothing, a small share changes the logits, not what a cache holds."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.backends import get_backend
from mlx_flash.batching.batch_cache import padded_mask
from mlx_flash.offload.quantized_kv import make_row_caches
from mlx_flash.offload.sparse_attention import TopKAttention, top_k_mask_reference, visible_reference, with_top_k


@pytest.fixture(scope="module", params=["torch", "mlx"])
def ops(request):
    return get_backend(request.param)


def qk(rng, B=2, Hq=4, Hkv=2, T=3, S=11, hd=8):
    return (
        rng.standard_normal((B, Hq, T, hd)).astype(np.float32),
        rng.standard_normal((B, Hkv, S, hd)).astype(np.float32),
    )


def loop_reference(q, k, scale, vis, keep):
    """The same selection, one query at a time."""
    B, Hq, T, _ = q.shape
    rep = Hq // k.shape[1]
    out = np.zeros((B, Hq, T, k.shape[2]), bool)
    for b in range(B):
        for h in range(Hq):
            for t in range(T):
                seen = np.flatnonzero(vis[b if vis.shape[0] > 1 else 0, 0, t])
                scores = (k[b, h // rep, seen].astype(np.float64) @ q[b, h, t].astype(np.float64)) * scale
                n = max(int(np.ceil(len(seen) * keep)), 1)
                out[b, h, t, seen[np.argsort(-scores, kind="stable")[:n]]] = True
    return out


@pytest.mark.parametrize("keep", [0.1, 0.3, 0.5, 1.0])
def test_reference_keeps_each_querys_top_share(keep):
    rng = np.random.default_rng(0)
    q, k = qk(rng)
    lengths = np.array([11, 6])
    for mask in (
        None,
        "causal",
        np.arange(11)[None, None, None, :] <= (lengths[:, None, None, None] - 3 + np.arange(3)[None, None, :, None]),
    ):
        vis = np.broadcast_to(visible_reference(mask, 2, 3, 11), (2, 1, 3, 11))
        got = top_k_mask_reference(q, k, 0.35, mask, keep)
        np.testing.assert_array_equal(got, loop_reference(q, k, 0.35, vis, keep))
        if keep == 1.0:
            np.testing.assert_array_equal(got, np.broadcast_to(vis, got.shape))


@pytest.mark.parametrize("keep", [0.1, 0.25, 1.0])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padded"])
def test_backend_top_k_mask_equals_the_reference(ops, keep, mask_kind):
    rng = np.random.default_rng(1)
    q, k = qk(rng, T=1 if mask_kind == "none" else 3)
    T = q.shape[2]
    lengths = np.array([11, 5])
    mask = {"none": None, "causal": "causal", "padded": None}[mask_kind]
    backend_mask = mask
    if mask_kind == "padded":
        backend_mask = padded_mask(ops, lengths, T)
        mask = visible_reference(backend_mask, 2, T, 11)
    got = ops.to_numpy(ops.top_k_mask(ops.array(q), ops.array(k), 0.35, backend_mask, keep)).astype(bool)
    np.testing.assert_array_equal(got, top_k_mask_reference(q, k, 0.35, mask, keep))


@pytest.fixture(params=["torch", "mlx"])
def tiny(request, tiny_store):
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend=request.param, ffn="resident", progress=False) as e:
        yield e


def test_wrapper_changes_attention_only(tiny):
    e = tiny
    ids = np.random.default_rng(2).integers(3, 96, size=40).tolist()
    L, cap = e.args.num_hidden_layers, 64
    exact = e.prefill(ids, make_row_caches(e, 0, cap), all_logits=True)
    assert with_top_k(c := make_row_caches(e, 0, cap), 1.0) is c  # keep 1.0: nothing wrapped
    full = with_top_k(make_row_caches(e, 0, cap), 0.999999)  # a share that keeps every key
    np.testing.assert_allclose(e.prefill(ids, full, all_logits=True), exact, atol=1e-5, rtol=0)
    sparse = with_top_k(make_row_caches(e, 0, cap), 0.1)
    got = e.prefill(ids, sparse, all_logits=True)
    assert isinstance(sparse[0], TopKAttention) and sparse[0].offset == len(ids)
    np.testing.assert_allclose(got[0], exact[0], atol=1e-5, rtol=0)  # the first query sees one key: kept
    assert np.abs(got[1:] - exact[1:]).max(axis=-1).min() > 1e-4  # every later one drops keys
    ref = make_row_caches(e, 0, cap)
    e.prefill(ids, ref)
    for x, y in zip(sparse[0].state(e.ops), ref[0].state(e.ops)):  # the first layer's KV, before any
        np.testing.assert_array_equal(x, y)  # sparse attention fed it, is held as it was computed
    with pytest.raises(ValueError):
        TopKAttention(ref[0], 0.0)
    assert L == len(sparse)
