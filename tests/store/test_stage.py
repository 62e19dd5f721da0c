"""A pipeline stage's store (store/stage.py): the layers one rank runs, cut out of a whole store as a
valid store of their own, layers renumbered from 0 and per-layer config lists sliced, every byte as
the whole store has it; cutting again keeps the cut there."""

import numpy as np

from mlx_flash.store import open_store
from mlx_flash.store.safetensors_io import tensor_layer
from mlx_flash.store.stage import cut_stage, dropped_tensors, stage_config


def test_a_stage_holds_its_layers_as_stored(store_dir, tmp_path):
    whole = open_store(store_dir)
    m = whole.manifest
    layers = range(10, 20)
    stage = open_store(cut_stage(whole, layers, str(tmp_path / "stage")))  # validated like any store
    s = stage.manifest
    assert s.config["num_hidden_layers"] == 10
    assert s.source["stage"] == {"layers": [10, 20], "of": 30, "dropped": []}
    assert {tensor_layer(n) for n in s.tensors} - {None} == set(range(10))
    old = whole.read_resident()
    new = stage.read_resident()
    for name, (a, _) in new.items():
        layer = tensor_layer(name)
        src = name if layer is None else name.replace(f"layers.{layer}.", f"layers.{layer + 10}.", 1)
        assert np.asarray(a).tobytes() == np.asarray(old[src][0]).tobytes(), name
    assert len(new) == len(old) - 20 * len([n for n in old if tensor_layer(n) == 0])
    for i in range(10):
        got = stage.read_bytes(s.ffn.file, s.ffn.layer_offsets[i], s.ffn.layer_nbytes)
        want = whole.read_bytes(m.ffn.file, m.ffn.layer_offsets[10 + i], m.ffn.layer_nbytes)
        assert np.array_equal(got, want), i
    assert stage.layer_regions() is not None  # each layer still one contiguous range: streamable
    again = cut_stage(whole, layers, str(tmp_path / "stage"))
    assert open_store(again).manifest.to_json() == s.to_json()


def test_per_layer_config_lists_are_sliced():
    cfg = {
        "num_hidden_layers": 6,
        "layer_types": ["s", "s", "s", "s", "s", "f"],
        "hidden_size": 64,
        "rope_scaling": {"factor": [1, 2]},
    }
    out = stage_config(cfg, range(3, 6))
    assert out == {
        "num_hidden_layers": 3,
        "layer_types": ["s", "s", "f"],
        "hidden_size": 64,
        "rope_scaling": {"factor": [1, 2]},
    }


def test_an_inner_stage_leaves_out_the_embeddings_and_head(store_dir, tmp_path):
    """A rank other than 0 never embeds or samples: its stage holds its layers alone, names what it
    left out, and loads (the graph's embeddings and head are None there), holding that much less."""
    import mlx_flash

    whole = open_store(store_dir)
    outside = sorted(n for n in whole.manifest.tensors if tensor_layer(n) is None)
    assert "model.embed_tokens.weight" in outside
    inner = open_store(cut_stage(whole, range(15, 30), str(tmp_path / "inner"), outer=False))
    assert all(tensor_layer(n) is not None for n in inner.manifest.tensors)
    assert dropped_tensors(inner) == frozenset(outside) and dropped_tensors(whole) == frozenset()
    outer = cut_stage(whole, range(15, 30), str(tmp_path / "outer"))
    with mlx_flash.load(inner.path, backend="torch", ffn="resident", progress=False) as e:
        assert e.weights["embed"] is None and e.weights["head"] is None and len(e.weights["layers"]) == 15
        held_inner = e.ops.held_bytes(e.weights)
    with mlx_flash.load(outer, backend="torch", ffn="resident", progress=False) as e:
        held_outer = e.ops.held_bytes(e.weights)
    embed = whole.manifest.tensors["model.embed_tokens.weight"].nbytes
    assert held_outer - held_inner >= embed
