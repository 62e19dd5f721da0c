"""Conversion: a GGUF file, an HF directory or an mlx-community directory -> a store directory.

  convert(source, out_dir, precision=..., ...)   write a store (atomic); `python -m mlx_flash.convert`
  PRECISIONS                                     the FFN precisions convert() takes
  CONVERTER_VERSION                              bumped when the output for the same input changes
  read_source(path) -> SourceModel               a checkpoint in canonical form (names, config, quant)

Reads the source tensor by tensor with the field's readers and writes the format store/ defines;
may import models/ (each architecture normalizes its own config and tensor names).

`mlx_flash.convert` is also the public function (mlx_flash/__init__.py binds it over this package's
name), so import from here with `from mlx_flash.convert import ...`, not `import mlx_flash.convert as`.
"""

from .converter import CONVERTER_VERSION, PRECISIONS, convert
from .source_model import SourceModel
from .sources import read_source

__all__ = ["convert", "PRECISIONS", "CONVERTER_VERSION", "read_source", "SourceModel"]
