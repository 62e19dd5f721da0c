"""Row-column bundle codec: numpy only (I/O code never touches framework arrays).

A bundle is the bytes one FFN neuron needs: its gate row, up row and down column (and per-neuron
biases), back to back. Fields start on 4-byte boundaries so packed uint32 words stay aligned.
"""

from __future__ import annotations

import numpy as np

from .manifest import BundleField

# numpy dtype used to hold each storage dtype (bfloat16 travels as raw 16-bit words).
NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "uint32": np.uint32,
    "int32": np.int32,
    "uint8": np.uint8,
    "int8": np.int8,
}
FIELD_ALIGN = 4


def plan_fields(parts: list[tuple[str, np.ndarray, str]]) -> tuple[list[BundleField], int]:
    """parts: (field name, array [F, ...], storage dtype name) in bundle order -> fields, bundle bytes."""
    fields, off = [], 0
    for name, arr, dtype in parts:
        off = -(-off // FIELD_ALIGN) * FIELD_ALIGN
        f = BundleField(name=name, offset=off, dtype=dtype, shape=list(arr.shape[1:]))
        fields.append(f)
        off += f.nbytes
    return fields, -(-off // FIELD_ALIGN) * FIELD_ALIGN


def pack_layer(fields: list[BundleField], bundle_bytes: int, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Interleave per-neuron rows of each field into a [F, bundle_bytes] uint8 matrix."""
    n = next(iter(arrays.values())).shape[0]
    out = np.zeros((n, bundle_bytes), dtype=np.uint8)
    for f in fields:
        a = np.ascontiguousarray(arrays[f.name]).reshape(n, -1)
        out[:, f.offset : f.offset + f.nbytes] = a.view(np.uint8).reshape(n, f.nbytes)
    return out


def unpack_rows(fields: list[BundleField], rows: np.ndarray) -> dict[str, np.ndarray]:
    """Split a [n, bundle_bytes] uint8 matrix into contiguous per-field arrays [n, *shape]."""
    n = rows.shape[0]
    out = {}
    for f in fields:
        raw = np.ascontiguousarray(rows[:, f.offset : f.offset + f.nbytes])
        out[f.name] = raw.view(NUMPY_DTYPES[f.dtype]).reshape([n, *f.shape])
    return out
