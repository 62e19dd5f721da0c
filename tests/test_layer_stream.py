"""Streamed layers: when the weights' share of the memory limit cannot hold every layer's attention,
the last layers' resident tensors are read into two slots as they compute. The output is the
resident model's, bit for bit, on both backends."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.store import open_store
from mlx_flash.store.store import ALIGN, lead

PROMPT = list(range(20, 60))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_streamed_layers_equal_resident(store_dir, engines, backend):
    if backend == "torch":
        pytest.importorskip("torch")
    store = open_store(store_dir)
    regions = store.layer_regions()
    assert regions is not None and len(regions) == store.config["num_hidden_layers"], (
        "the converter writes each layer's tensors together"
    )
    ref = engines(store_dir, backend).logits(PROMPT)
    # 40 MB for weights: not the 40.4 MB of embeddings and attention plus a streamed FFN, so layers stream
    with mlx_flash.load(store_dir, backend=backend, weights_budget="40MB", context=128, progress=False) as e:
        streamed = e.memory_plan["streamed_layers"]
        assert 0 < streamed < len(regions)
        assert e.layer_slots is not None
        assert e.layer_slots.nbytes == 2 * max(lead(off) + n for _, off, n in regions.values())
        got = e.logits(PROMPT)
        np.testing.assert_array_equal(got, ref)
        before = e.layer_slots.read_counts[0]
        e.logits(PROMPT[:4])
        # every streamed layer is read once per forward pass (its region, no more)
        per_pass = sum(regions[i][2] for i in range(len(regions) - streamed, len(regions)))
        assert e.layer_slots.read_counts[0] - before >= per_pass


@pytest.mark.slow
def test_weights_budget_below_the_minimum_is_refused(store_dir):
    with pytest.raises(mlx_flash.ConfigError, match=r"weights budget 30\.0 MB .*is below the minimum 3[0-9.]+ MB"):
        mlx_flash.load(store_dir, backend="mlx", weights_budget="30MB", progress=False)


@pytest.mark.slow
def test_context_is_planned_and_enforced(store_dir):
    with mlx_flash.load(store_dir, backend="mlx", context=24, progress=False) as e:
        assert e.context_limit == 24 and e.memory_plan["kv_tokens"] == 24
        e.logits(PROMPT[:24])
        with pytest.raises(mlx_flash.ConfigError, match="25 tokens exceed the 24 tokens the memory plan holds KV"):
            e.logits(PROMPT[:25])


def decode_steps(store, backend, **kw) -> np.ndarray:
    """Logits of 8 decode steps after a 24-token prompt."""
    with mlx_flash.load(store, backend=backend, progress=False, io=mlx_flash.IOOptions(mode="buffered"), **kw) as e:
        caches = e.new_caches()
        e.prefill(PROMPT[:24], caches)
        return np.stack([e.forward([t], caches)[-1] for t in PROMPT[24:32]])


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_streamed_layers_decode_equals_resident(tiny_store, backend):
    """Decode steps too, where the head multiplies one row: a float tensor read with the resident
    tensors of a streamed model lies at its file alignment, as in a resident model (torch's CPU GEMV
    rounded differently at 8- and 16-byte aligned weights: the tiny model's float head did)."""
    if backend == "torch":
        pytest.importorskip("torch")
    store, _ = tiny_store("llama", precision="q4", num_hidden_layers=8)
    streamed = dict(ffn="stream", weights_budget="70%")
    with mlx_flash.load(store, backend=backend, progress=False, **streamed) as e:
        assert e.layer_slots is not None  # the last layers stream
    np.testing.assert_array_equal(decode_steps(store, backend, **streamed), decode_steps(store, backend))


def test_every_read_keeps_a_tensor_at_its_file_alignment(tiny_store):
    store = open_store(tiny_store("llama", precision="q4", num_hidden_layers=4)[0])
    entries = store.manifest.tensors
    assert any(t.offset % ALIGN for t in entries.values())  # the file itself packs tensors 8-byte aligned
    for skip in ((), (2, 3)):
        for name, (a, _) in store.read_resident(skip).items():
            assert a.ctypes.data % ALIGN == entries[name].offset % ALIGN, name
