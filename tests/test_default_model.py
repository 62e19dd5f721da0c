"""The default model is found without importing its package and converted once into the cache."""

import os

from mlx_flash.default_model import DEFAULT_FILE, resolve_store
from mlx_flash.store import is_store


def test_default_model_converts_once(default_gguf, tmp_path):
    assert default_gguf.endswith(DEFAULT_FILE)
    first = resolve_store(None, str(tmp_path), progress=False)
    assert is_store(first) and first.startswith(str(tmp_path))
    mtime = os.path.getmtime(os.path.join(first, "manifest.json"))
    assert resolve_store(None, str(tmp_path), progress=False) == first
    assert os.path.getmtime(os.path.join(first, "manifest.json")) == mtime
    assert resolve_store(first, str(tmp_path / "elsewhere")) == first  # a store is used as is
