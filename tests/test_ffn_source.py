"""Every FFN source answers stats() with the same dataclass (every field present), reset() and
close(); the engine's per-token I/O numbers are the differences of those stats. Expert sources
yield routed experts in ascending order; the newcomer's example source (mlx_flash/README.md) works."""

import dataclasses
import os
import re

import numpy as np
import pytest

import mlx_flash
from mlx_flash.ffn_source import ExpertSource, FFNStats, LayerSource

FIELDS = {f.name for f in dataclasses.fields(FFNStats)}


@pytest.mark.parametrize(
    "ffn,options",
    [
        ("resident", {}),
        ("stream", {}),
        ("sparse", {"flash": mlx_flash.FlashOptions(predictor="dense"), "weights_budget": "160%"}),
    ],
)
def test_dense_sources_share_the_protocol(tiny_store, ffn, options):
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend="torch", ffn=ffn, progress=False, **options) as e:
        assert isinstance(e.ffn, LayerSource)
        before = e.ffn.stats()
        e.generate("a b c", max_tokens=4)
        after = e.ffn.stats()
        assert isinstance(after, FFNStats) and set(vars(after)) == FIELDS
        read = after.bytes_read - before.bytes_read
        assert sum(s.bytes_read for s in e.last.steps) <= read  # decode steps; the prompt read the rest
        if ffn == "resident":
            assert after == FFNStats()
        else:
            assert read > 0 and after.reads > before.reads
        assert (after.sparse_mode == "all") == (ffn == "sparse")
        e.ffn.reset()


def test_expert_source_reports_its_cache(tiny_store):
    store, _ = tiny_store("mixtral")
    with mlx_flash.load(store, backend="torch", ffn="stream", weights_budget="60%", progress=False) as e:
        e.generate("a b c", max_tokens=4)
        st = e.ffn.stats()
        assert st.expert_policy and st.expert_slots > 0 and len(st.expert_hits) == e.args.num_hidden_layers
        assert st.bytes_read > 0 and st.sparse_mode == ""


def test_expert_sources_yield_routed_experts_in_ascending_order(tiny_store):
    store, _ = tiny_store("mixtral")
    routing = np.array([[3, 1], [1, 0]])
    for ffn, budget in (("resident", None), ("stream", "60%")):
        with mlx_flash.load(store, backend="torch", ffn=ffn, weights_budget=budget, progress=False) as e:
            assert isinstance(e.ffn, ExpertSource)
            assert [k for k, _ in e.ffn.experts(0, routing)] == [0, 1, 3]


def test_a_source_must_say_what_it_provides():
    class Nothing(LayerSource):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Nothing()


def test_the_readme_example_source_computes_what_the_resident_one_does(tiny_store):
    """The example of mlx_flash/README.md, run as written."""
    from mlx_flash.store.reader_pool import ReaderPool

    readme = open(os.path.join(os.path.dirname(mlx_flash.__file__), "README.md")).read()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[-1]
    scope = {}
    exec(code, scope)
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        want = e.logits([5, 6, 7])
        with ReaderPool(threads=1, mode="buffered") as pool:
            src = scope["CountingFFN"](e.ops, e.store, pool)
        e.ffn = src
        assert np.array_equal(e.logits([5, 6, 7]), want)
        assert src.calls == [1] * e.args.num_hidden_layers and src.stats() == FFNStats()


def test_a_streamed_layer_is_read_every_step_but_its_weights_built_once_per_buffer(store_dir):
    """Eager backend, weights that are views of the read buffers (the default model's Q4_1 bundles):
    each call reads the layer again, but builds nothing once a buffer has held that layer, and the
    logits equal the resident engine's."""
    store = store_dir
    ids = [1, 5, 9, 2]
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False) as e:
        want = np.asarray(e.forward(ids, e.new_caches(), all_logits=True))
    with mlx_flash.load(store, backend="torch", ffn="stream", progress=False) as e:
        L = e.args.num_hidden_layers
        assert e.ffn.keep_views  # in place: what the cache is for
        first = [e.ffn.layer(i) for i in range(L)] + [e.ffn.layer(i) for i in range(L)]
        reads = e.ffn.stats().reads
        built = dict(e.ffn.views)
        again = [e.ffn.layer(i) for i in range(L)] + [e.ffn.layer(i) for i in range(L)]
        assert e.ffn.stats().reads > reads  # read again
        assert e.ffn.views == built and all(a is b for a, b in zip(first, again))  # built once
        got = np.asarray(e.forward(ids, e.new_caches(), all_logits=True))
    np.testing.assert_array_equal(got, want)
