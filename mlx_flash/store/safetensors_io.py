"""Minimal safetensors writer that reports where each tensor landed, so the manifest can record
absolute byte offsets (the format: 8-byte little-endian header length, JSON header, packed data)."""

from __future__ import annotations

import json
import struct

import numpy as np

from .manifest import TensorEntry

_ST_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32", "int32": "I32",
    "uint8": "U8", "int8": "I8",
}


def write_safetensors(path: str, arrays: dict[str, tuple[np.ndarray, str]], file_name: str) -> dict[str, TensorEntry]:
    """arrays: name -> (numpy array, storage dtype name). Returns the manifest entries."""
    header, layout, pos = {}, [], 0
    for name in sorted(arrays):
        a, dtype = arrays[name]
        n = a.nbytes
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(a.shape), "data_offsets": [pos, pos + n]}
        layout.append((name, a, dtype, pos))
        pos += n
    header["__metadata__"] = {"format": "mlx_flash"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # keep the data region 8-byte aligned
    base = 8 + len(hb)
    entries = {}
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)))
        fh.write(hb)
        for name, a, dtype, off in layout:
            fh.write(np.ascontiguousarray(a).tobytes())
            entries[name] = TensorEntry(file=file_name, offset=base + off, shape=list(a.shape), dtype=dtype, nbytes=a.nbytes)
    return entries
