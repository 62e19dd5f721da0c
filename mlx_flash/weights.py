"""The compute edge: turn store bytes (numpy) into backend weights, and supply each layer's FFN
either from memory (resident) or freshly read from the bundle file (stream).

Both modes decode the same bundle bytes into the same backend weights, so their outputs are
bit-identical; streaming only changes where the bytes come from and when.
"""

from __future__ import annotations

import time

import numpy as np

from .errors import StoreError
from .store.bundles import unpack_rows
from .store.ffn_reader import FFNReader
from .store.manifest import FFNLayout
from .store.store import Store


def resident_getter(ops, store: Store):
    """get(name) for model.build(): a backend Weight for linears/embeddings (given without
    ".weight"), a backend array for vectors (given in full); None for absent optional tensors."""
    arrays = store.read_resident()
    quant = store.manifest.quant

    def get(name: str, optional: bool = False):
        if name + ".weight" in arrays:
            parts, dtypes = {}, {}
            for part in ("weight", "scales", "biases", "bias"):
                if f"{name}.{part}" in arrays:
                    parts[part], dtypes[part] = arrays[f"{name}.{part}"]
            return ops.weight(parts, quant.get(name), transposed=False, dtypes=dtypes)
        if name in arrays:
            a, dtype = arrays[name]
            return ops.array(a, dtype)
        if optional:
            return None
        raise StoreError(f"{store.path}: tensor {name} is missing from the store")

    return get


def bundle_weights(ops, layout: FFNLayout, rows: np.ndarray) -> dict:
    """[n, bundle_bytes] bundle rows -> {"gate"?, "up", "down"} backend weights (down transposed)."""
    fields = unpack_rows(layout.fields, rows)
    dtypes = {f.name: f.dtype for f in layout.fields}
    out = {}
    for role in ("gate", "up", "down"):
        if f"{role}.weight" not in fields:
            continue
        parts, dt = {}, {}
        for part in ("weight", "scales", "biases", "bias"):
            key = f"{role}.{part}"
            if key in fields:
                parts[part] = fields[key].reshape(-1) if part == "bias" else fields[key]
                dt[part] = dtypes[key]
        out[role] = ops.weight(parts, layout.quant.get(role), transposed=role == "down", dtypes=dt)
    return out


class ResidentFFN:
    """All FFN bundles read once at load time and kept as backend weights."""

    def __init__(self, ops, store: Store):
        layout = store.manifest.ffn
        reader = FFNReader(store.file_path(layout.file), layout)
        try:
            self.layers = [bundle_weights(ops, layout, reader.read_layer(i)) for i in range(len(layout.layer_offsets))]
        finally:
            reader.close()
        self.stats = None

    def layer(self, i: int) -> dict:
        return self.layers[i]

    def close(self) -> None:
        self.layers = []


class StreamedFFN:
    """Each call reads layer i's bundle region from the file and decodes it (nothing kept)."""

    def __init__(self, ops, store: Store):
        self.ops = ops
        self.layout = store.manifest.ffn
        self.reader = FFNReader(store.file_path(self.layout.file), self.layout)
        self.io_seconds = 0.0
        self.mem_seconds = 0.0

    def layer(self, i: int) -> dict:
        t0 = time.perf_counter()
        rows = self.reader.read_layer(i)
        t1 = time.perf_counter()
        w = bundle_weights(self.ops, self.layout, rows)
        self.io_seconds += t1 - t0
        self.mem_seconds += time.perf_counter() - t1
        return w

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    @property
    def reads(self) -> int:
        return self.reader.reads

    def close(self) -> None:
        self.reader.close()
