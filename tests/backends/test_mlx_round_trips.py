"""Host round trips per token on the MLX backend: every evaluation (mx.eval, mx.async_eval) and every
export of an MLX array to the host (item, tolist, __array__, numpy's array/asarray/ascontiguousarray/
frombuffer; a bare memoryview is not wrapped, memoryview being a type the package tests with
isinstance) is counted while the engine decodes the default model; a decode step of a
dense model costs exactly one (its logits), the products, embedding rows, attention, norms, rope and
the KV cache's append all inside the token's one graph."""

import contextlib

import mlx.core as mx
import numpy as np
import pytest

import mlx_flash

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def counted_round_trips():
    """Yields a list that grows by one entry (what was called) per evaluation or export."""
    calls = []
    patched = []

    def wrap(owner, name, test=lambda *a, **k: True):
        orig = getattr(owner, name)

        def counting(*a, **k):
            if test(*a, **k):
                calls.append(name)
            return orig(*a, **k)

        setattr(owner, name, counting)
        patched.append((owner, name, orig))

    is_mx = lambda a=None, *rest, **k: isinstance(a, mx.array)  # noqa: E731
    try:
        wrap(mx, "eval")
        wrap(mx, "async_eval")
        for name in ("item", "tolist", "__array__"):
            wrap(mx.array, name)
        for name in ("array", "asarray", "ascontiguousarray", "frombuffer"):
            wrap(np, name, is_mx)
        yield calls
    finally:
        for owner, name, orig in reversed(patched):
            setattr(owner, name, orig)


MODES = {
    "resident": dict(ffn="resident"),
    "stream": dict(ffn="stream"),  # every layer's FFN read per token, in turn with the graph
    "hybrid": dict(ffn="sparse", flash=mlx_flash.FlashOptions(mode="hybrid"), weights_budget="70%"),
    # auto under a weights budget that holds neither every FFN nor every layer's attention: layers stream
    "streamed layers": dict(weights_budget="40MB", context=128),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_dense_decode_step_is_one_round_trip(store_dir, mode):
    with mlx_flash.load(store_dir, backend="mlx", progress=False, **MODES[mode]) as e:
        ids = e.tokenizer.encode("The history of the city begins in the year")
        caches = e.new_caches()
        logits = e.prefill(ids, caches)
        token = int(np.argmax(logits))
        read = e.io_bytes()
        with counted_round_trips() as calls:
            for _ in range(8):
                token = int(np.argmax(e.forward([token], caches)[-1]))
        assert len(calls) == 8, f"{len(calls)} round trips for 8 tokens: {calls}"
        assert (e.io_bytes() > read) == (mode != "resident"), "the streamed modes read every token"


def test_the_counter_sees_an_export():
    """The net catches what it claims to: a product evaluated per call would be counted."""
    with counted_round_trips() as calls:
        a = mx.ones((3,)) + 1
        np.array(a)
        a.item() if a.size == 1 else a.tolist()
        mx.eval(a)
    assert calls == ["array", "tolist", "eval"]


@pytest.mark.parametrize("mode,predictor", [("all", "dense"), ("window", "statistical")])
def test_a_sparse_decode_step_is_at_most_one_round_trip_per_layer(store_dir, mode, predictor):
    """A predictor may read each layer's FFN input on the host (the I/O decision: at most one round
    trip a layer); the kernel's products over the neuron cache stay in the graph. (The caches hold every
    active row: rows past a cache take the reference path.)"""
    flash = mlx_flash.FlashOptions(mode=mode, predictor=predictor)
    with mlx_flash.load(store_dir, backend="mlx", ffn="sparse", flash=flash, weights_budget="200%",
                        io=mlx_flash.IOOptions(mode="buffered"), progress=False) as e:
        ids = e.tokenizer.encode("The history of the city begins in the year")
        caches = e.new_caches()
        token = int(np.argmax(e.prefill(ids, caches)))
        with counted_round_trips() as calls:
            for _ in range(4):
                token = int(np.argmax(e.forward([token], caches)[-1]))
        layers = e.args.num_hidden_layers
        assert e.ffn.stats().sparse_kernel == "cpu"
        assert len(calls) <= 4 * (layers + 1), f"{len(calls)} round trips for 4 tokens of {layers} layers"
