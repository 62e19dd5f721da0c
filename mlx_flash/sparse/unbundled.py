"""The unbundled FFN layout: per layer, each field (gate rows, up rows, down columns, biases) as its
own matrix, so one neuron needs one read per field. It exists only to measure what bundling saves
(LLM in a flash Table 2, "+bundling"); it is derived from the bundle file on first use."""

from __future__ import annotations

import os

import numpy as np

from ..durable import DurableFile
from ..errors import StoreError
from ..store.atomic_dir import OutputError
from ..store.manifest import FFNLayout

FILE_NAME = "ffn_unbundled.bin"
ALIGN = 4096


def field_offsets(layout: FFNLayout) -> tuple[list[list[int]], int]:
    """Per layer, the file offset of each field's matrix; and the file size."""
    pos, out = 0, []
    for _ in layout.layer_offsets:
        row = []
        for f in layout.fields:
            row.append(pos)
            pos = -(-(pos + layout.n_rows * f.nbytes) // ALIGN) * ALIGN
        out.append(row)
    return out, pos


def ensure_unbundled(store, progress: bool = False) -> str:
    """Path of the store's unbundled FFN file, writing it (atomically) if absent."""
    layout = store.manifest.ffn
    path = store.file_path(FILE_NAME)
    offsets, size = field_offsets(layout)
    if os.path.isfile(path):
        if os.path.getsize(path) != size:
            raise StoreError(f"{path}: {os.path.getsize(path)} bytes, expected {size} (delete it to rebuild)")
        return path
    from tqdm import tqdm

    buf = np.empty(layout.layer_nbytes, dtype=np.uint8)  # one layer at a time: no mapping of the whole file
    with open(store.file_path(layout.file), "rb") as src, DurableFile(path, OutputError, needed=size) as fh:
        fh.reserve(size)
        for layer, base in enumerate(
            tqdm(layout.layer_offsets, desc="unbundled layout", unit="layer", disable=not progress)
        ):
            src.seek(base)
            src.readinto(memoryview(buf))
            rows = buf.reshape(layout.n_rows, layout.bundle_bytes)
            for f, off in zip(layout.fields, offsets[layer]):
                fh.write_at(np.ascontiguousarray(rows[:, f.offset : f.offset + f.nbytes]), off)
    return path
