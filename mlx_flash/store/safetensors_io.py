"""Minimal safetensors writer that reports where each tensor landed, so the manifest can record
absolute byte offsets (the format: 8-byte little-endian header length, JSON header, packed data)."""

from __future__ import annotations

import json
import re
import struct

import numpy as np

from ..durable import FolderFile
from .atomic_dir import OutputError
from .manifest import DTYPE_SIZES, TensorEntry

_ST_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "uint32": "U32",
    "int32": "I32",
    "uint8": "U8",
    "int8": "I8",
}


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def tensor_layer(name: str) -> int | None:
    """The transformer layer a tensor belongs to ("model.layers.3.self_attn.q_proj.weight" -> 3)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def file_order(names, adjacent: list[list[str]] = ()) -> list[str]:
    """The order tensors are written in: layer by layer, each layer's tensors one contiguous region
    (so a layer can be read, or streamed, with one read), within it each `adjacent` run back to back
    (so a reader can take the run as one array, a view of the file's bytes) and then the rest sorted
    by name; the tensors of no layer (embeddings, final norm, head) last, sorted."""
    names = set(names)
    runs = [[n for n in run if n in names] for run in adjacent]
    by_layer: dict[int | None, list[str]] = {}
    for run in runs:
        if run:
            by_layer.setdefault(tensor_layer(run[0]), []).extend(run)
    placed = {n for run in runs for n in run}
    for n in sorted(names - placed):
        by_layer.setdefault(tensor_layer(n), []).append(n)
    layers = sorted(k for k in by_layer if k is not None)
    return [n for k in layers for n in by_layer[k]] + by_layer.get(None, [])


def safetensors_layout(
    specs: dict[str, tuple[list[int], str]], file_name: str, adjacent: list[list[str]] = ()
) -> tuple[bytes, dict[str, TensorEntry]]:
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


def write_safetensors(
    path: str, specs: dict[str, tuple[list[int], str]], produce, file_name: str, adjacent: list[list[str]] = ()
) -> dict[str, TensorEntry]:
    """specs: name -> (shape, storage dtype name); `produce(name)` returns that tensor's data (a numpy
    array of that many bytes), called once per tensor in file order, so only one tensor need be in
    memory at a time; `adjacent`: runs of names written back to back (file_order). Returns the
    manifest entries."""
    head, entries = safetensors_layout(specs, file_name, adjacent)
    total = len(head) + sum(e.nbytes for e in entries.values())
    with FolderFile(path, OutputError, needed=total) as fh:  # (inside a store's folder, written whole: atomic_dir)
        fh.reserve(total)  # a disk too small says so now, naming the bytes, not after the first GBs
        fh.write(head)
        for name in file_order(specs, adjacent):
            data = np.ascontiguousarray(produce(name))
            if data.nbytes != entries[name].nbytes:
                raise ValueError(f"{name}: {data.nbytes} bytes produced for a {entries[name].nbytes}-byte tensor")
            fh.write(data.reshape(-1).view(np.uint8))
            del data
    return entries
