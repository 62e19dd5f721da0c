"""The compute edge: turn store bytes (numpy) into backend weights, and supply each layer's FFN
either from memory (resident) or freshly read from the bundle file (stream).

Both modes decode the same bundle bytes into the same backend weights, so their outputs are
bit-identical; streaming only changes where the bytes come from and when.
"""

from __future__ import annotations

import time

import numpy as np

from .backends import owner
from .errors import ConfigError, StoreError
from .ffn_source import FFNStats, FFNWeights, LayerSource
from .kernels.blockmatmul import BlockMatrix
from .kernels.qmatmul import KERNEL_BITS, StoredMatrix
from .quant_spec import BLOCKS
from .store.bundles import NUMPY_DTYPES, unpack_rows
from .store.ffn_reader import FFNReader
from .store.manifest import FFNLayout
from .store.safetensors_io import tensor_layer
from .store.stage import dropped_tensors
from .store.store import Store

PARTS = ("weight", "scales", "biases", "bias")


def linear_parts(arrays: dict, name: str) -> tuple[dict, dict]:
    """The stored pieces of linear `name` from {tensor name: (array, storage dtype)}: its parts
    (weight, scales/biases when quantized, bias) and their storage dtypes."""
    parts, dtypes = {}, {}
    for part in PARTS:
        if f"{name}.{part}" in arrays:
            parts[part], dtypes[part] = arrays[f"{name}.{part}"]
    return parts, dtypes


def fused_weight(ops, members: list[tuple[dict, dict]], quants: list):
    """One backend weight with the members' rows stacked (one matmul instead of several), or a tuple
    of weights when they differ in quantization or parts (models.common.linear then concatenates
    their outputs, which is what the fused matmul computes)."""
    (parts0, dtypes0), q0 = members[0], quants[0]
    if any(q != q0 or p.keys() != parts0.keys() or dt != dtypes0 for (p, dt), q in zip(members, quants)):
        return tuple(ops.weight(p, q, dtypes=dt) for (p, dt), q in zip(members, quants))
    return ops.weight({k: join_rows([p[k] for p, _ in members]) for k in parts0}, q0, dtypes=dtypes0)


def join_rows(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays stacked along their first axis: a view when they lie back to back in one buffer
    (the converter stores a fused group's parts that way, and the resident tensors are views of
    the file's bytes), else a copy."""
    a0, root = arrays[0], owner(arrays[0])
    end = a0.ctypes.data
    for a in arrays:
        if (
            a.dtype != a0.dtype
            or a.shape[1:] != a0.shape[1:]
            or not a.flags.c_contiguous
            or a.ctypes.data != end
            or owner(a) is not root
        ):
            return np.concatenate(arrays)
        end += a.nbytes
    if root.dtype != np.uint8 or not root.flags.c_contiguous:  # views are cut from the file's uint8 buffer
        return np.concatenate(arrays)
    flat = root.reshape(-1)  # (a buffer past 1 GiB comes as rows of 4 KiB from MLX: kernels/mlx_kernels.py)
    start = a0.ctypes.data - root.ctypes.data
    return flat[start : start + (end - a0.ctypes.data)].view(a0.dtype).reshape(-1, *a0.shape[1:])


class _Tensors:
    """{name: (array, dtype)} of the resident tensors read at load, and of streamed layers through
    their slots (layer_stream.LayerSlots), which read a layer when one of its tensors is asked for."""

    def __init__(self, arrays: dict, slots):
        self.arrays, self.slots = arrays, slots

    def _where(self, name: str) -> dict:
        layer = tensor_layer(name)
        if self.slots is not None and layer in self.slots:
            return self.slots.arrays(layer)
        return self.arrays

    def __contains__(self, name: str) -> bool:
        return name in self._where(name)

    def __getitem__(self, name: str):
        return self._where(name)[name]


def resident_getter(ops, store: Store, slots=None):
    """get(name) for model.build(): a backend Weight for linears/embeddings (given without
    ".weight"; a list of names gives them fused), a backend array for vectors (given in full);
    None for absent optional tensors. The layers of `slots` (streamed) are views of their slot."""
    arrays = _Tensors(store.read_resident(slots.order if slots is not None else (), ops.host_buffer), slots)
    quant = store.manifest.quant
    dropped = dropped_tensors(store)  # an inner pipeline stage's: embeddings, head (its blocks never read them)

    def parts_of(name):
        if name + ".weight" not in arrays:
            raise StoreError(f"{store.path}: tensor {name}.weight is missing from the store")
        return linear_parts(arrays, name)

    def get(name, optional: bool = False):
        if isinstance(name, (list, tuple)):
            return fused_weight(ops, [parts_of(n) for n in name], [quant.get(n) for n in name])
        if name + ".weight" in arrays:
            parts, dtypes = parts_of(name)
            return ops.weight(parts, quant.get(name), dtypes=dtypes)
        if name in arrays:
            a, dtype = arrays[name]
            return ops.array(a, dtype)
        if optional or name in dropped or name + ".weight" in dropped:
            return None
        raise StoreError(f"{store.path}: tensor {name} is missing from the store")

    return get


def neuron_arrays(layout: FFNLayout, rows: np.ndarray, fields=None) -> tuple[dict, bool]:
    """Bundle rows [n, row_bytes] (of `fields`, default the layout's) -> ({field: (array, storage
    dtype)}, down_transposed). Gate/up rows and per-neuron biases come one row per neuron. Down comes
    as the compute takes it: for bundles of one neuron, rows of the transposed matrix [n, D] (down
    columns; transposed True); for blocks, the down matrix's slice [D, n*block] in its own
    orientation, the blocks' groups side by side (transposed False); whole-expert `down_rows`
    formats join their pieces into [D, Fe] (transposed False)."""
    fields = layout.fields if fields is None else fields
    dtypes = {f.name: f.dtype for f in fields}
    out = {}
    for k, v in unpack_rows(fields, rows).items():
        if k.endswith(".bias"):
            v = v.reshape(-1)
        elif k.startswith("down."):
            if layout.block > 1:  # [n, D, per-block] -> [D, n * per-block]
                v = np.ascontiguousarray(v.transpose(1, 0, 2)).reshape(v.shape[1], -1)
            elif layout.down_rows:  # a whole expert's down matrix [D, Fe], cut into its Fe bundles
                v = v.reshape(layout.d_model, -1)
        elif layout.block > 1:  # [n, block, ...] -> [n * block, ...]
            v = v.reshape(-1, *v.shape[2:])
        out[k] = (v, dtypes[k])
    return out, layout.block == 1 and not layout.down_rows


def in_place(ops, layout: FFNLayout) -> bool:
    """Whether bundle rows of this layout are multiplied where they lie (bundle_views): always for
    GGUF block types (the block kernel reads them nowhere else); for affine ones, blocks of neurons
    quantized at a width the CPU kernel reads, without per-neuron biases, on a backend whose linears
    run that kernel."""
    if layout.has_blocks:
        return True
    roles = ("gate", "up", "down") if layout.gated else ("up", "down")
    affine = (
        ops.in_place_kernel
        and all(layout.quant.get(r) is not None and layout.quant[r].bits in KERNEL_BITS for r in roles)
        and not any(f.name.endswith(".bias") for f in layout.fields)
    )
    if layout.down_rows:  # whole-expert down matrices: in place when each bundle holds whole rows of it
        return affine and down_rows_per_bundle(layout) > 0
    return affine and layout.block > 1 and layout.quant["down"].group_size == layout.block


def down_rows_per_bundle(layout: FFNLayout) -> int:
    """A whole-expert (`down_rows`) format: how many rows of the expert's [D, Fe] down matrix each of
    its Fe bundles holds, when every bundle holds whole rows (D a multiple of Fe: the rows' codes,
    scales and biases were cut into Fe equal pieces), else 0."""
    n = layout.expert_rows
    return layout.d_model // n if n and layout.d_model % n == 0 else 0


def bundle_views(ops, layout: FFNLayout, rows: np.ndarray, quant: dict) -> FFNWeights:
    """Backend weights that read a layer's bundles where they lie ([n, bundle_bytes] rows, C-contiguous):
    gate and up as blocks of rows (one per bundle), down as a matrix whose groups are the bundles;
    `quant`: this layer's (FFNLayout.quant_of). No byte is copied; the weights are valid while
    `rows` holds this layer."""
    nb, bb = rows.shape
    f = {x.name: x for x in layout.fields}
    if any(x.endswith(".bias") for x in f):
        raise ConfigError("FFN bundles with per-neuron biases are not multiplied in place")

    def rows_of(role, per_bundle=layout.block):  # [bundles, rows, groups, words per group], scales/biases
        q, w = quant[role], f[f"{role}.weight"]
        if q.is_block:  # row n: bundle n // block, row n % block of its field
            return ops.kernel_weight(
                BlockMatrix.in_buffer(
                    rows,
                    w.offset,
                    q.kind,
                    nb * layout.block,
                    layout.d_model,
                    layout.block,
                    bb,
                    w.shape[-1],
                    BLOCKS[q.kind].nbytes,
                ),
                q,
            )
        s = f[f"{role}.scales"]
        wpg = q.group_size * q.bits // 32
        ss = np.dtype(NUMPY_DTYPES[s.dtype]).itemsize
        groups = s.nbytes // (per_bundle * ss)  # a row's groups
        dt = NUMPY_DTYPES[s.dtype]
        views = [
            np.ndarray((nb, per_bundle, groups, wpg), np.uint32, rows, w.offset, (bb, groups * wpg * 4, wpg * 4, 4))
        ]
        views += [
            np.ndarray((nb, per_bundle, groups), dt, rows, f[f"{role}.{p}"].offset, (bb, groups * ss, ss))
            for p in ("scales", "biases")
        ]
        return ops.kernel_weight(StoredMatrix(*views, q.bits, q.group_size, True, s.dtype == "bfloat16"), q)

    def down():  # row d, group b: bundle b's slice of row d
        if layout.down_rows:  # bundle i: rows i r .. (i + 1) r of the expert's [D, Fe] matrix, as stored
            return rows_of("down", down_rows_per_bundle(layout))
        q, w = quant["down"], f["down.weight"]
        if q.is_block:
            return ops.kernel_weight(
                BlockMatrix.in_buffer(
                    rows, w.offset, q.kind, layout.d_model, nb * layout.block, layout.d_model, 0, w.shape[-1], bb
                ),
                q,
            )
        s = f["down.scales"]
        D, wpg, ss = w.shape[0], w.shape[1], s.nbytes // s.shape[0]
        dt = NUMPY_DTYPES[s.dtype]
        views = [np.ndarray((1, D, nb, wpg), np.uint32, rows, w.offset, (0, wpg * 4, bb, 4))]
        views += [np.ndarray((1, D, nb), dt, rows, f[f"down.{p}"].offset, (0, ss, bb)) for p in ("scales", "biases")]
        return ops.kernel_weight(StoredMatrix(*views, q.bits, q.group_size, True, s.dtype == "bfloat16"), q)

    if not layout.gated:
        return FFNWeights(up=rows_of("up"), down=down())
    return FFNWeights(gate_up=(rows_of("gate"), rows_of("up")), down=down())


def bundle_weights(ops, layout: FFNLayout, rows: np.ndarray, layer: int = 0) -> FFNWeights:
    """[n, bundle_bytes] bundle rows of `layer` -> backend weights: gate_up and down for gated FFNs
    (gate and up rows fused), up and down otherwise (see neuron_arrays for down's orientation).
    Where the layout allows (in_place), views of the rows themselves (bundle_views): valid while
    `rows` holds this layer."""
    if in_place(ops, layout):
        if layout.has_blocks and not rows.flags.c_contiguous:
            rows = np.ascontiguousarray(rows)
        if rows.flags.c_contiguous:
            return bundle_views(ops, layout, rows, layout.quant_of(layer))
    arrays, transposed = neuron_arrays(layout, rows)
    d, ddt = linear_parts(arrays, "down")
    down = ops.weight(d, layout.quant.get("down"), transposed=transposed, dtypes=ddt)
    if not layout.gated:
        up, dt = linear_parts(arrays, "up")
        return FFNWeights(up=ops.weight(up, layout.quant.get("up"), dtypes=dt), down=down)
    gate_up = fused_weight(
        ops,
        [linear_parts(arrays, "gate"), linear_parts(arrays, "up")],
        [layout.quant.get("gate"), layout.quant.get("up")],
    )
    return FFNWeights(gate_up=gate_up, down=down)


class ResidentFFN(LayerSource):
    """All FFN bundles read once at load time (through `pool`) and kept as backend weights."""

    same_for_every_input = True

    def __init__(self, ops, store: Store, pool):
        layout = store.manifest.ffn
        reader = FFNReader(pool, store.file_path(layout.file), layout)
        own = in_place(ops, layout)  # weights that are views need each layer in a buffer of its own
        self.layers = [
            bundle_weights(ops, layout, reader.read_into(i, ops.host_buffer) if own else reader.read_layer(i), i)
            for i in range(len(layout.layer_offsets))
        ]

    def layer(self, i: int, x=None) -> FFNWeights:
        return self.layers[i]

    def close(self) -> None:
        self.layers = []


class TurnedLayers:
    """FFN layers read per call into a reader's buffers (the backend's memory), taking turns with a
    lazy graph (slot_turns.py): each call claims the next buffer; the read (and `fill`, which writes
    into the rows read, e.g. hybrid's resident rows) runs once the buffer's previous layer is
    computed, and the products wait for it inside the graph. A layer's weights over a buffer are built
    once and kept (views of the buffer), so a call builds nothing."""

    def __init__(self, ops, reader: FFNReader, name: str):
        self.ops, self.reader = ops, reader
        self.turns = ops.slot_turns(name)
        self.calls = 0
        self.holds: list = [None] * len(reader.bufs)
        self.weights: dict[tuple[int, int], FFNWeights] = {}

    def layer(self, i: int, skip_rows: int = 0, fill=None) -> FFNWeights:
        b = self.calls % len(self.reader.bufs)
        self.calls += 1
        rows = self.reader.rows_of(b)
        if self.holds[b] == i:  # this buffer still holds the layer
            self.turns.claim(b, lambda: None)
        else:
            self.holds[b] = i

            def read():
                batch = self.reader.read_rows(i, b, skip_rows)
                if fill is not None:
                    fill(rows)
                return batch

            self.turns.claim(b, read)
        w = self.weights.get((b, i))
        if w is None:
            w = self.weights[(b, i)] = bundle_weights(self.ops, self.reader.layout, rows, i)
            self.ops.gate_weights(w, self.turns.gate(b))
        return w

    def close(self) -> None:
        self.turns.close()


def turned_layers(ops, reader: FFNReader, name: str) -> TurnedLayers | None:
    """TurnedLayers for a lazy backend when the layout's weights are views of the buffer (in_place);
    None where layers are read and computed in turn in Python (an eager backend, or weights built as
    copies, which would copy a buffer before its read)."""
    if not (ops.lazy and in_place(ops, reader.layout)):
        return None
    return TurnedLayers(ops, reader, name)


class StreamedFFN(LayerSource):
    """Each call reads layer i's bundle region through the pool and decodes it (nothing kept), but
    for layers `place` holds. Counters: io_seconds (blocked on reads), mem_seconds (decoding bytes
    into backend weights), bytes_read, reads."""

    same_for_every_input = True

    def __init__(self, ops, store: Store, pool):
        self.ops = ops
        self.pool = pool
        self.layout = store.manifest.ffn
        self.reader = FFNReader(
            pool, store.file_path(self.layout.file), self.layout, prefetch=True, alloc=ops.host_buffer
        )
        self.turned = turned_layers(ops, self.reader, "mlx-flash-ffn-turns")
        self.mem_seconds = 0.0
        self.held: dict[int, FFNWeights] = {}
        # (buffer, layer) -> weights viewing it, built once (the CPU kernel's; a device's copies are not kept)
        self.views: dict[tuple[int, int], FFNWeights] = {}
        self.keep_views = ops.in_place_kernel and in_place(ops, self.layout)

    def layer(self, i: int, x=None) -> FFNWeights:
        if i in self.held:
            return self.held[i]
        if self.turned is not None:
            return self.turned.layer(i)
        rows = self.reader.read_layer(i)
        key = (self.reader.last_buffer, i)
        w = self.views.get(key)
        if w is None:
            t = time.perf_counter()
            w = bundle_weights(self.ops, self.layout, rows, i)
            self.mem_seconds += time.perf_counter() - t
            if self.keep_views and rows.flags.c_contiguous:
                self.views[key] = w
        return w

    def place(self, resident: int, read_ahead: bool = True) -> int:
        """Hold the first `resident` layers' FFNs in memory as stored (a throughput policy's weight
        placement; each in a buffer of its own, its weights views of it) and read the others, each
        next one's read started when a layer is handed out unless `read_ahead` is off (the
        no-overlap ablation). Returns the bytes held."""
        n = len(self.layout.layer_offsets)
        self.held = {
            i: self.held.get(i)
            or bundle_weights(self.ops, self.layout, self.reader.read_into(i, self.ops.host_buffer), i)
            for i in range(resident)
        }
        self.reader.order = list(range(resident, n)) or list(range(n))
        self.reader.prefetch = read_ahead
        return resident * self.layout.layer_nbytes

    def stats(self) -> FFNStats:
        r, t = self.reader, self.turned
        wait, nbytes, reads = (
            (t.turns.wait_seconds, t.turns.bytes_read, t.turns.reads) if t is not None else (0.0, 0, 0)
        )
        return FFNStats(
            io_seconds=r.wait_seconds + wait,
            mem_seconds=self.mem_seconds,
            bytes_read=r.bytes_read + nbytes,
            reads=r.reads + reads,
        )

    def close(self) -> None:
        self.held = {}
        self.views = {}
        if self.turned is not None:
            self.turned.close()
        self.reader.close()
        self.pool.close()
