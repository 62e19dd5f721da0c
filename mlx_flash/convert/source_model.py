"""The canonical form every source checkpoint is read into (convert/sources.py: `read_source`; GGUF
files by convert/gguf_source.py, HF and mlx-community directories by sources.py): HF-style tensor
names, a normalized config and per-linear quantization."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..quant_spec import QuantSpec
from .tensor_source import SourceTensors


@dataclass
class SourceModel:
    config: dict  # normalized by the architecture's module; always has "model_type"
    tensors: SourceTensors  # canonical name -> tensor, read when taken
    quant: dict[str, QuantSpec]  # linear base name -> quantization of its .weight/.scales/.biases
    save_tokenizer: Callable[[str], None]
    description: dict

    @property
    def name(self) -> str:
        """The source as a message names it: its file or directory."""
        return str(self.description.get("file") or self.description.get("dir") or self.description)
