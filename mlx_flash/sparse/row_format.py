"""How a cached FFN row is laid out, where it is read from, and how rows become weights.

A row holds one bundle's bytes (one neuron, or a block of neurons when the store keeps the source's
down groups, see FFNLayout): a whole bundle (gate rows | up rows | down, `BundleRows`) or, in
down-only mode, its down part alone (`DownRows`; gate/up come from the gate predictor's
resident 4-bit copy, which has already computed the activations). `weights()` is the one place rows
turn into backend weights: the seam where compute on the stored bytes plugs in.

Rows come from the bundle file (one range per bundle, `BundleFile`) or from the unbundled copy that
keeps each field as its own matrix (one range per field, `FieldFile`).
"""

from __future__ import annotations

import numpy as np

from ..ffn_source import FFNWeights
from ..store.bundles import pack_layer, plan_fields, unpack_rows
from ..store.manifest import BundleField, FFNLayout
from ..weights import bundle_weights, linear_parts, neuron_arrays
from .selectors import Selection


def block_neurons(row_ids: np.ndarray, block: int) -> np.ndarray:
    """The neurons of bundles `row_ids`, in order (int64)."""
    ids = np.asarray(row_ids, dtype=np.int64)
    return ids if block == 1 else (ids[:, None] * block + np.arange(block)).reshape(-1)


def down_fields(layout: FFNLayout) -> tuple[list[BundleField], list[int], int]:
    """The down-projection fields of a bundle packed into a row of their own, laid out like any
    bundle: (fields with their offsets in that row, their indices in layout.fields, row bytes)."""
    index = [k for k, f in enumerate(layout.fields) if f.name.startswith("down.")]
    fields, row_bytes = plan_fields(
        [(layout.fields[k].name, np.empty((0, *layout.fields[k].shape)), layout.fields[k].dtype) for k in index]
    )
    return fields, index, row_bytes


class BundleRows:
    """Whole bundles: what the store holds, as it holds it."""

    def __init__(self, ops, layout: FFNLayout):
        self.ops, self.layout = ops, layout
        self.fields, self.index, self.row_bytes = layout.fields, list(range(len(layout.fields))), layout.bundle_bytes

    def from_layer(self, rows: np.ndarray) -> np.ndarray:
        """A whole layer's bundle rows [F, bundle_bytes] in this format (a prompt chunk's rows)."""
        return rows

    def weights(self, layer: int, rows: np.ndarray, selection: Selection, row_ids=None) -> FFNWeights:
        return bundle_weights(self.ops, self.layout, rows, layer)


class DownRows:
    """Down columns only; gate/up and the activations come from the gate selector (sparse.gateup)."""

    def __init__(self, ops, layout: FFNLayout, gate_up: list):
        self.ops, self.layout, self.gate_up = ops, layout, gate_up
        self.fields, self.index, self.row_bytes = down_fields(layout)

    def from_layer(self, rows: np.ndarray) -> np.ndarray:
        down = unpack_rows([self.layout.fields[k] for k in self.index], rows)
        return pack_layer(self.fields, self.row_bytes, down)

    def weights(self, layer: int, rows: np.ndarray, selection: Selection, row_ids=None) -> FFNWeights:
        arrays, transposed = neuron_arrays(self.layout, rows, self.fields)
        d, ddt = linear_parts(arrays, "down")
        neurons = None if row_ids is None else block_neurons(row_ids, self.layout.block)
        return FFNWeights(
            gate_up=self.gate_up[layer],
            hidden=selection.hidden,
            down=self.ops.weight(d, self.layout.quant.get("down"), transposed=transposed, dtypes=ddt),
            rows=None if neurons is None else self.ops.array(neurons),
        )


class BundleFile:
    """Rows from the bundle file: one range per bundle."""

    def __init__(self, pool, file, layout: FFNLayout):
        self.pool, self.file, self.layout = pool, file, layout

    def submit(self, layer: int, ids: np.ndarray, flat: np.ndarray, slots: np.ndarray):
        """Start reading bundles `ids` into rows `slots` of `flat` (a [rows * row_bytes] view)."""
        bb = self.layout.bundle_bytes
        return self.pool.submit_rows(
            self.file, self.layout.layer_offsets[layer] + ids * bb, bb, flat, slots * bb, row_bytes=bb
        )


class FieldFile:
    """Rows from the unbundled file, one range per field of the row format, from that field's matrix."""

    def __init__(self, pool, file, field_offsets: list, fmt):
        self.pool, self.file, self.offsets, self.fmt = pool, file, field_offsets, fmt

    def submit(self, layer: int, ids: np.ndarray, flat: np.ndarray, slots: np.ndarray):
        offs, lens, douts = [], [], []
        rb = self.fmt.row_bytes
        for f, k in zip(self.fmt.fields, self.fmt.index):
            offs.append(self.offsets[layer][k] + ids * f.nbytes)
            lens.append(np.full(ids.size, f.nbytes))
            douts.append(slots * rb + f.offset)
        return self.pool.submit_rows(
            self.file, np.concatenate(offs), np.concatenate(lens), flat, np.concatenate(douts), row_bytes=rb
        )
