"""Converter: atomic output, progress-free API use, and one named error per bad source."""

import os
import shutil

import pytest

import tiny_models

from mlx_flash.convert import converter as convert_mod
from mlx_flash.convert import convert
from mlx_flash.errors import ConfigError, ModelFileError, ModelNotFoundError, UnsupportedModelError
from mlx_flash.store import is_store, open_store


def test_crash_midway_leaves_nothing(tiny_store, tmp_path, monkeypatch):
    _, _ = tiny_store("llama")
    src = str(tmp_path / "llama-hf")
    calls = {"n": 0}
    real = convert_mod.pack_layer

    def boom(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the bundle file
        return real(*a, **k)

    monkeypatch.setattr(convert_mod, "pack_layer", boom)
    out = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        convert(src, str(out), progress=False)
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if "partial" in p], "temporary directory left behind"


def test_existing_output_needs_force(tiny_store, tmp_path):
    store, _ = tiny_store("llama")
    with pytest.raises(ConfigError, match="already exists"):
        convert(str(tmp_path / "llama-hf"), store, progress=False)
    convert(str(tmp_path / "llama-hf"), store, progress=False, force=True)
    assert is_store(store)


def test_missing_source(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nope.gguf: no such file"):
        convert(str(tmp_path / "nope.gguf"), str(tmp_path / "out"), progress=False)


def test_truncated_gguf(default_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as fh:
        bad.write_bytes(fh.read(30_000_000))
    with pytest.raises(ModelFileError, match=r"cut\.gguf: unreadable GGUF .*past the end of the file"):
        convert(str(bad), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"hello world")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        convert(str(bad), str(tmp_path / "out"), progress=False)


def test_unsupported_model_type(tiny_store, tmp_path):
    tiny_store("llama")
    src = tmp_path / "llama-hf"
    tiny_models.edit_config(src, model_type="bert")
    with pytest.raises(UnsupportedModelError, match="model_type 'bert' is not supported"):
        convert(str(src), str(tmp_path / "out"), progress=False)


def test_hf_dir_problems(tiny_store, tmp_path):
    tiny_store("llama")
    src = tmp_path / "llama-hf"
    no_tok = tmp_path / "no-tok"
    shutil.copytree(src, no_tok)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(no_tok / f)
    with pytest.raises(ModelFileError, match="no tokenizer files"):
        convert(str(no_tok), str(tmp_path / "o1"), progress=False)
    assert not (tmp_path / "o1").exists()
    (src / "config.json").write_text("{broken")
    with pytest.raises(ModelFileError, match="config.json: not valid JSON"):
        convert(str(src), str(tmp_path / "o2"), progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFileError, match="no config.json"):
        convert(str(empty), str(tmp_path / "o3"), progress=False)


def test_missing_ffn_tensor(tiny_store, tmp_path):
    """A checkpoint whose tensors disagree with its config is refused by name."""
    tiny_store("llama")
    src = tmp_path / "llama-hf"
    tiny_models.edit_config(src, num_hidden_layers=3)  # the weights have 2 layers
    with pytest.raises(ModelFileError, match=r"model\.layers\.2\.mlp\.gate_proj\.weight is missing"):
        convert(str(src), str(tmp_path / "out"), progress=False)


def test_store_records_every_tensor(tiny_store):
    store, _ = tiny_store("qwen2")
    m = open_store(store, verify_checksums=True).manifest
    assert "model.layers.0.self_attn.q_proj.bias" in m.tensors
    assert not any(".mlp." in n for n in m.tensors), "FFN tensors belong in the bundle file only"
    assert m.ffn.n_neurons == m.config["intermediate_size"]
