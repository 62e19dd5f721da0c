"""Minimal safetensors writer that reports where each tensor landed, so the manifest can record
absolute byte offsets (the format: 8-byte little-endian header length, JSON header, packed data)."""

from __future__ import annotations

import json
import struct

import numpy as np

from .manifest import DTYPE_SIZES, TensorEntry

_ST_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32", "int32": "I32",
    "uint8": "U8", "int8": "I8",
}


def file_order(names, adjacent: list[list[str]] = ()) -> list[str]:
    """The order tensors are written in: each `adjacent` run back to back (so a reader can take the
    run as one array, a view of the file's bytes), then the rest sorted by name."""
    names = set(names)
    order = [n for run in adjacent for n in run if n in names]
    return order + sorted(names - set(order))


def safetensors_layout(specs: dict[str, tuple[list[int], str]], file_name: str,
                       adjacent: list[list[str]] = ()) -> tuple[bytes, dict[str, TensorEntry]]:
    """specs: name -> (shape, storage dtype name). Returns the bytes that open the file (length + JSON
    header, padded so the data starts 8-byte aligned) and each tensor's manifest entry; the caller
    then writes the data of each tensor in `file_order(specs, adjacent)`."""
    header, entries, pos = {}, {}, 0
    for name in file_order(specs, adjacent):
        shape, dtype = specs[name]
        n = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        entries[name] = TensorEntry(file=file_name, offset=pos, shape=list(shape), dtype=dtype, nbytes=n)
        pos += n
    header["__metadata__"] = {"format": "mlx_flash"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # keep the data region 8-byte aligned
    base = 8 + len(hb)
    for e in entries.values():
        e.offset += base
    return struct.pack("<Q", len(hb)) + hb, entries


def write_safetensors(path: str, specs: dict[str, tuple[list[int], str]], produce, file_name: str,
                      adjacent: list[list[str]] = ()) -> dict[str, TensorEntry]:
    """specs: name -> (shape, storage dtype name); `produce(name)` returns that tensor's data (a numpy
    array of that many bytes), called once per tensor in file order, so only one tensor need be in
    memory at a time; `adjacent`: runs of names written back to back (file_order). Returns the
    manifest entries."""
    head, entries = safetensors_layout(specs, file_name, adjacent)
    with open(path, "wb") as fh:
        fh.write(head)
        for name in file_order(specs, adjacent):
            data = np.ascontiguousarray(produce(name))
            if data.nbytes != entries[name].nbytes:
                raise ValueError(f"{name}: {data.nbytes} bytes produced for a {entries[name].nbytes}-byte tensor")
            fh.write(memoryview(data.reshape(-1).view(np.uint8)))
            del data
    return entries
