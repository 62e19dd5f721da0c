"""Every FFN source answers stats() with the same dataclass (every field present), reset() and
close(); the engine's per-token I/O numbers are the differences of those stats."""

import dataclasses

import pytest

import mlx_flash
from mlx_flash.ffn_source import FFNSource, FFNStats

FIELDS = {f.name for f in dataclasses.fields(FFNStats)}


@pytest.mark.parametrize("ffn,options", [("resident", {}), ("stream", {}),
                                         ("sparse", {"predictor": "dense", "memory_budget": "160%"})])
def test_dense_sources_share_the_protocol(tiny_store, ffn, options):
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend="torch", ffn=ffn, progress=False, **options) as e:
        assert isinstance(e.ffn, FFNSource)
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
    with mlx_flash.load(store, backend="torch", ffn="stream", memory_budget="60%", progress=False) as e:
        e.generate("a b c", max_tokens=4)
        st = e.ffn.stats()
        assert st.expert_policy and st.expert_slots > 0 and len(st.expert_hits) == e.args.num_hidden_layers
        assert st.bytes_read > 0 and st.sparse_mode == ""
