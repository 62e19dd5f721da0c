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

    def get(name, optional: bool = False):
        if isinstance(name, (list, tuple)):  # several linears fused along the output axis
            return _fused([_parts(n) for n in name], [quant.get(n) for n in name])
        if name + ".weight" in arrays:
            parts, dtypes = _parts(name)
            return ops.weight(parts, quant.get(name), transposed=False, dtypes=dtypes)
        if name in arrays:
            a, dtype = arrays[name]
            return ops.array(a, dtype)
        if optional:
            return None
        raise StoreError(f"{store.path}: tensor {name} is missing from the store")

    def _parts(name):
        if name + ".weight" not in arrays:
            raise StoreError(f"{store.path}: tensor {name}.weight is missing from the store")
        parts, dtypes = {}, {}
        for part in ("weight", "scales", "biases", "bias"):
            if f"{name}.{part}" in arrays:
                parts[part], dtypes[part] = arrays[f"{name}.{part}"]
        return parts, dtypes

    def _fused(members, quants):
        """One weight with the members' rows stacked; a tuple of weights when they differ in
        quantization or parts (models.common.linear concatenates their outputs instead)."""
        if any(q != quants[0] for q in quants) or any(m[0].keys() != members[0][0].keys() for m in members) \
                or any(m[1] != members[0][1] for m in members):
            return tuple(ops.weight(p, q, transposed=False, dtypes=dt) for (p, dt), q in zip(members, quants))
        parts = {k: np.concatenate([m[0][k] for m in members]) for k in members[0][0]}
        return ops.weight(parts, quants[0], transposed=False, dtypes=members[0][1])

    return get


def bundle_weights(ops, layout: FFNLayout, rows: np.ndarray) -> dict:
    """[n, bundle_bytes] bundle rows -> backend weights: {"gate_up", "down"} for gated FFNs (gate and
    up rows fused into one [2n, D] matrix: one matmul instead of two), {"up", "down"} otherwise.
    Down is stored transposed ([n, D] rows of down columns)."""
    fields = unpack_rows(layout.fields, rows)
    dtypes = {f.name: f.dtype for f in layout.fields}

    def parts(role):
        p, dt = {}, {}
        for part in ("weight", "scales", "biases", "bias"):
            key = f"{role}.{part}"
            if key in fields:
                p[part] = fields[key].reshape(-1) if part == "bias" else fields[key]
                dt[part] = dtypes[key]
        return p, dt

    d, ddt = parts("down")
    down = ops.weight(d, layout.quant.get("down"), transposed=True, dtypes=ddt)
    if not layout.gated:
        up, dt = parts("up")
        return {"up": ops.weight(up, layout.quant.get("up"), dtypes=dt), "down": down}
    (g, dt), (u, _) = parts("gate"), parts("up")
    if layout.quant.get("gate") != layout.quant.get("up") or g.keys() != u.keys():
        raise StoreError(f"FFN gate and up rows differ in quantization ({layout.quant})")
    gate_up = ops.weight({k: np.concatenate([g[k], u[k]]) for k in g}, layout.quant.get("gate"), dtypes=dt)
    return {"gate_up": gate_up, "down": down}


class ResidentFFN:
    """All FFN bundles read once at load time (through `pool`) and kept as backend weights."""

    def __init__(self, ops, store: Store, pool):
        layout = store.manifest.ffn
        reader = FFNReader(pool, store.file_path(layout.file), layout)
        self.layers = [bundle_weights(ops, layout, reader.read_layer(i)) for i in range(len(layout.layer_offsets))]

    def layer(self, i: int) -> dict:
        return self.layers[i]

    def close(self) -> None:
        self.layers = []


class StreamedFFN:
    """Each call reads layer i's bundle region through the pool and decodes it (nothing kept).
    Counters: io_seconds (blocked on reads), mem_seconds (decoding bytes into backend weights),
    bytes_read, reads."""

    def __init__(self, ops, store: Store, pool):
        self.ops = ops
        self.pool = pool
        self.layout = store.manifest.ffn
        self.reader = FFNReader(pool, store.file_path(self.layout.file), self.layout)
        self.mem_seconds = 0.0

    def layer(self, i: int) -> dict:
        rows = self.reader.read_layer(i)
        t = time.perf_counter()
        w = bundle_weights(self.ops, self.layout, rows)
        self.mem_seconds += time.perf_counter() - t
        return w

    @property
    def io_seconds(self) -> float:
        return self.reader.wait_seconds

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    @property
    def reads(self) -> int:
        return self.reader.reads

    def close(self) -> None:
        self.pool.close()
