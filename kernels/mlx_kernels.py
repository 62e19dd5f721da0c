"""The CPU kernels as MLX graph operations (the extension _mlx_kernels, built at install from
kernels/mlx/): a product over stored bytes, rows of a stored matrix and attention become nodes of
MLX's lazy graph, evaluated with the rest of a token's forward, instead of Python calls that make MLX
evaluate and copy activations to the host before each one.

Weights reach a primitive as a uint8 buffer input plus byte offsets: the buffer is memory MLX
allocated (`framework_buffer`) that the reader pool filled in place, found from the numpy views the
I/O code hands out (`buffer_of`); the kernel reads the bytes where the read put them. A matrix over
memory MLX did not allocate (a test's numpy array) is copied into MLX memory once, when its operation
is built.

The extension links one MLX version; a different one installed, or no extension built, raises
KernelUnavailableError in one line at load, naming the fix.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_flash.errors import KernelUnavailableError

from . import qmatmul
from .blockmatmul import BlockMatrix
from .channel_major import ACTS
from .qmatmul import Arith, StoredMatrix
from .kv_codes import pairs_ints
from .stored_operands import Listed, one_buffer, operands, layer_specs

PAGE = 4096  # buffers start on a page: direct reads land in them without a bounce
_EXT = None  # the extension, loaded and checked once per process (like qmatmul's library)


def extension():
    """The loaded extension, checked against the MLX running (once per process)."""
    global _EXT
    if _EXT is not None:
        return _EXT
    try:
        ext = importlib.import_module(__name__.rpartition(".")[0] + "._mlx_kernels")
    except ImportError as e:
        raise KernelUnavailableError(
            f"the MLX kernels extension (mlx_flash.kernels._mlx_kernels) is not built or does "
            f"not load ({e}); reinstall the package (pip install -e . or make install) with "
            "cmake and a C++17 compiler"
        ) from None
    if ext.mlx_version() != mx.__version__:
        raise KernelUnavailableError(
            f"the MLX kernels extension was built for MLX {ext.mlx_version()}, and MLX "
            f"{mx.__version__} is installed; install mlx=={ext.mlx_version()} or rebuild "
            "(pip install -e .)"
        )
    qmatmul.library()  # loads and checks the CPU kernel library first
    ext.load_kernel_library(qmatmul.library_path())
    _EXT = ext
    return ext


def framework_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` of uninitialized memory MLX allocated, page-aligned, as a writable uint8 numpy view
    (what the reader pool fills); the view keeps the MLX array alive."""
    a = extension().empty(max(int(nbytes), 1), PAGE)
    mx.eval(a)
    return np.asarray(a).reshape(-1)[:nbytes]


def buffer_of(view: np.ndarray) -> tuple[mx.array, int] | None:
    """(the MLX array whose memory `view` lies in, view's byte offset in it), or None when the memory
    is not MLX's. Nothing is exported: the numpy array at the start of the view's chain is the MLX
    array's own export (framework_buffer made it), starting where the array does."""
    a = view
    while isinstance(a.base, np.ndarray):
        a = a.base
    obj = a.base.obj if isinstance(a.base, memoryview) else None
    if not isinstance(obj, mx.array):
        return None
    return obj, view.ctypes.data - a.ctypes.data


@dataclass(frozen=True)
class Located:
    """Where a matrix's parts lie for a primitive: one uint8 MLX buffer and byte offsets into it.
    `external`: the buffer wraps numpy memory the I/O code may reuse (a read buffer): products over
    it are evaluated when built, before the memory can change."""

    buffer: mx.array
    offsets: tuple
    external: bool


def framework_array(view: np.ndarray) -> mx.array:
    """An mx.array over a contiguous uint8 numpy view of framework_buffer memory without a copy (a
    slice of the MLX buffer it lies in; on a Mac also what Metal kernels read); other memory is copied."""
    found = buffer_of(view) if view.flags.c_contiguous and view.dtype == np.uint8 else None
    if found is None:
        return mx.array(view)
    mem, offset = found
    return mem.reshape(-1)[offset : offset + view.nbytes].reshape(view.shape)


def locate(views) -> Located:
    """The MLX buffer every view's memory lies in, with no copy: the MLX array itself when MLX
    allocated it; else the numpy memory they share, wrapped (external). Views of separate numpy
    arrays are copied into one MLX buffer (stored_operands.one_buffer)."""
    found = [buffer_of(v) for v in views]
    if all(f is not None and f[0] is found[0][0] for f in found):
        return Located(found[0][0], tuple(f[1] for f in found), False)
    buf, offsets, shared = one_buffer(views)
    if shared and buf.nbytes < 1 << 31:
        return Located(extension().wrap(buf.ctypes.data, buf.nbytes), tuple(offsets), True)
    dest = framework_buffer(buf.nbytes)  # a private copy: nothing else writes it
    dest[:] = buf
    mem, base = buffer_of(dest)
    return Located(mem, tuple(base + o for o in offsets), False)


class GraphMatrix:
    """A StoredMatrix or BlockMatrix as an MLX operation: `__call__(x)` is x [.., K] times it, lazily;
    `sparse(x, ids, n)` the product over n listed units (StoredMatrix.sparse's meaning), ids an MLX
    int32 array."""

    def __init__(self, matrix: StoredMatrix | BlockMatrix, threads: int, arith: Arith = Arith.EXACT):
        self.ext, self.threads = extension(), max(int(threads), 1)
        self.op = operands(matrix)
        self.arith = self.op.arithmetic(arith)  # what its products compute (q8 where the kernels read it)
        where = locate(self.op.views)
        self.buffer, self.offsets, self.external = (
            where.buffer,
            where.offsets + (0,) * (3 - len(where.offsets)),
            where.external,
        )
        self.k_in, self.n_out = self.op.k_in, self.op.n_out
        self.spec = self.op.spec(self.offsets, self.arith)  # the matrix as whole-layer operations take it
        self.matrix = matrix  # kept alive: its views are what the offsets point into
        # a streamed slot's turns (slot_turns.SlotGate: fences and the latest claim), or None: resident
        self.gate = None

    def __call__(self, x: mx.array) -> mx.array:
        return self._op(x, self.n_out, None, Listed.NONE)

    def sparse(self, x: mx.array, ids: mx.array, n: int) -> mx.array:
        """The product over n listed units (ids int32 [n], each checked by the caller to lie in range)."""
        n_out, listed = self.op.sparse_output(n)
        return self._op(x, n_out, ids, listed)

    def rows(self, ids: mx.array) -> mx.array:
        """Rows `ids` of a plain matrix as float32 [..ids, K] (embedding lookups), lazily; an id outside
        the matrix gives zeros (callers check ids first)."""
        if self.op.layout and self.op.kind == 0:
            raise ValueError("rows are read from plain matrices (rows one after another), not laid-out ones")
        w, s, b = self.offsets
        st, bits, group = self.op.quant
        first = self.op.views[0]
        scale_row = self.op.views[1].strides[0] if self.op.kind == 0 else 0
        return self.ext.stored_rows(
            ids,
            self.buffer,
            self.op.kind,
            w,
            s,
            b,
            st,
            bits,
            group,
            first.shape[0],
            self.k_in,
            first.strides[0],
            scale_row,
        )

    def input_buffer(self, x: mx.array) -> mx.array:
        """The buffer as a product over x takes it: for a streamed slot, its bytes once read, after x
        (this layer's input) is computed."""
        if self.gate is None:
            return self.buffer
        seq, turns = self.gate.seq, self.gate.turns
        return self.ext.await_fence(self.buffer, x, turns.ready, seq, turns.release, seq - 1)

    def _op(self, x, n_out, ids, listed):
        w, s, b = self.offsets
        st, bits, group = self.op.quant
        y = self.ext.stored_matmul(
            x,
            self.input_buffer(x),
            self.op.kind,
            w,
            s,
            b,
            st,
            bits,
            group,
            n_out,
            self.op.transposed,
            int(self.arith),
            self.op.layout,
            self.threads,
            ids,
            int(listed),
        )
        if self.external:  # the memory may be refilled once this returns
            mx.eval(y)
        return y


class GraphChannelMajor:
    """A ChannelMajorMatrix (channel_major.py) as an MLX operation: `__call__(x, threshold)` is x [.., K]
    times it, lazily, a row's channels with |x| <= threshold taken as zero (negative: the dense
    product). The layout is read where it lies when MLX allocated it (the matrix made with
    framework_buffer), else copied into MLX memory once here. Each evaluated thresholded product adds
    to `counters` (rows, active channels, active groups), held by the extension for its nodes; each
    dense one (a negative threshold: prompts, several rows) to `dense_counters`, so the first say what
    the thresholds skipped."""

    def __init__(self, cm_matrix, threads: int):
        self.ext, self.threads = extension(), max(int(threads), 1)
        self.buffer = framework_array(cm_matrix.buffer)
        self._counts, self._dense_counts = self.ext.CmCounters(), self.ext.CmCounters()
        self.n_out, self.k_in = cm_matrix.n_out, cm_matrix.k_in
        self.spec = (0, *cm_matrix.spec)  # [offset, n_out, k_in, bits, group, scale_type] in self.buffer
        self.matrix = cm_matrix
        self._op, self._args = self.ext.cm_matmul, (self.buffer, *self.spec)  # bound once: called every product

    @property
    def counters(self) -> np.ndarray:
        """int64 [3]: what the evaluated thresholded products counted so far."""
        return np.array(self._counts.values(), dtype=np.int64)

    @property
    def dense_counters(self) -> np.ndarray:
        """int64 [3]: what the evaluated dense products counted so far."""
        return np.array(self._dense_counts.values(), dtype=np.int64)

    def reset_counters(self) -> None:
        self._counts.reset()

    def __call__(self, x: mx.array, threshold: float) -> mx.array:
        counts = self._counts if threshold >= 0 else self._dense_counts
        return self._op(x, *self._args, threshold, self.threads, counts)


def cm_gated_ffn(x, gate_up: GraphChannelMajor, down: GraphChannelMajor, t_gu, t_down, up=None, act="silu"):
    """down(act(gate) * up) of x [.., K] as one node (kernels/cpu/channel_major_ffn.cpp): gate_up holds
    gate|up (2F outputs, gate first), or, with `up` (a GraphChannelMajor), the gate alone; gate and up
    skip x's channels with |x| <= t_gu, down the activations' with |h| <= t_down (negative: none). Each
    matrix counts as its own node would (thresholded into `counters`, dense into `dense_counters`); the
    result equals those nodes to the bit. act: "silu" or "gelu_tanh"."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {sorted(ACTS)} (got {act!r})")
    g, d, on = gate_up, down, t_gu >= 0
    return g.ext.cm_gated_ffn(
        *(x, g.buffer, g.spec, (up or g).buffer, () if up is None else up.spec, d.buffer, d.spec),
        *(t_gu, t_down, ACTS[act], g.threads, g._counts if on else g._dense_counts),
        None if up is None else up._counts if on else up._dense_counts,
        d._counts if t_down >= 0 else d._dense_counts,
    )


def gated_ffn(
    x: mx.array, gate: GraphMatrix, up: GraphMatrix | None, down: GraphMatrix, ids: mx.array | None = None, n: int = 0
) -> mx.array:
    """down(silu(gate) * up) of x [.., K] as one node of the graph; up None: gate is gate|up, one
    matrix of 2F outputs (gate first). With ids (MLX int32, each checked by the caller to lie in
    range): the sparse layer over n listed units of each matrix (StoredMatrix.sparse's meaning). The
    same products and activation as separate nodes, to the bit."""
    given = {}  # buffer -> what the node takes for it: one wait per streamed slot

    def take(m: GraphMatrix) -> mx.array:
        key = (id(m.buffer), id(m.gate))
        if key not in given:
            given[key] = m.input_buffer(x)
        return given[key]

    specs, listed = layer_specs((gate, up, down), n if ids is not None else None)
    y = gate.ext.gated_ffn(
        x, take(gate), specs[0], take(up or gate), specs[1], take(down), specs[2], gate.threads, ids, listed
    )
    if any(m.external for m in (gate, up or gate, down)):  # the memory may be refilled once this returns
        mx.eval(y)
    return y


def moe_experts(
    x: mx.array, ids: mx.array, weights: mx.array, total: mx.array, experts: dict, n_experts: int, threads: int
) -> mx.array:
    """total + every routed expert's gated FFN of its tokens times their router weights, experts
    ascending, as one node of the graph (kernels/cpu/moe_experts.cpp): x [N, D], ids int32 and weights
    [N, K], total [N, Dout]; experts: id -> (gate, up or None, down) GraphMatrix of the experts in this
    node (a routed one not among them adds nothing). Memory MLX did not allocate is read as built
    (evaluated before it can be refilled), as a GraphMatrix's own products are."""
    buffers, index = [], {}

    def entry(m: GraphMatrix | None) -> tuple:
        if m is None:
            return (-1, [])
        if id(m.buffer) not in index:
            index[id(m.buffer)] = len(buffers)
            buffers.append(m.buffer)
        return (index[id(m.buffer)], m.spec)

    rows = [tuple(entry(m) for m in experts[e]) if e in experts else ((-1, []),) * 3 for e in range(n_experts)]
    y = extension().moe_experts(x, ids, weights, total, buffers, rows, max(int(threads), 1))
    if any(m is not None and m.external for mats in experts.values() for m in mats):
        mx.eval(y)
    return y


def rms_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """x / sqrt(mean(x^2) + eps) * w over the last axis, lazily."""
    return extension().rms_norm(x, w, float(eps))


def rope(x: mx.array, inv_freq: mx.array, pos: mx.array, dims: int, traditional: bool, scale: float) -> mx.array:
    """Rotary position embedding of x [B, H, T, hd] from each row's first position pos int32 [B],
    pair i turning by inv_freq[i] (float32 [dims / 2]) per position times `scale`, lazily."""
    return extension().rope(x, inv_freq, pos, int(dims), bool(traditional), float(scale))


def silu_mul(g: mx.array, u: mx.array) -> mx.array:
    """silu(g) * u (rows along the last axis, each input with its own row stride), lazily."""
    return extension().silu_mul(g, u)


def write_tokens(buffer: mx.array, x: mx.array, offset: int) -> mx.array:
    """`buffer` [B, H, cap, hd] with x [B, H, T, hd] written at tokens offset.., in place (its memory
    is the result's), lazily: a KV cache's append without copying the cache."""
    return extension().write_tokens(buffer, x, int(offset))


def attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, threads: int, kv_len=None, q_pos=None, table=None, window=0
) -> mx.array:
    """softmax(scale q k^T) v, lazily (kernels/cpu/attention.cpp): q [B, Hq, T, hd]; k, v [B, Hkv, S, hd]
    (each row's queries the last T of its S keys, or per row kv_len / q_pos int32 [B]), or pools
    [blocks, Hkv, block_tokens, hd] with a slot table int32 [B, max_blocks]; window > 0: each query sees
    only its last `window` keys (its own included)."""
    return extension().attention(q, k, v, float(scale), max(int(threads), 1), kv_len, q_pos, table, int(window))


def attention_coded(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    threads: int,
    k_codes: mx.array,
    k_layout,
    v_codes: mx.array,
    v_layout,
    coded,
    kv_len,
    q_pos,
    table=None,
) -> mx.array:
    """Attention over compressed KV, lazily (kernels/cpu/attention.cpp mf_attention_coded): row b's
    first coded[0, b] keys and coded[1, b] values are read as codes through their layouts
    (kernels/kv_codes.py CodedLayout, over the uint8 buffers k_codes, v_codes; their blocks named by
    the slot table when given), dequantized a block at a time; the rest of its kv_len[b] are the float
    residuals k, v [B, Hkv, R, hd] from token 0."""
    return extension().attention_coded(
        q,
        k,
        v,
        float(scale),
        max(int(threads), 1),
        k_codes,
        list(k_layout.ints()),
        v_codes,
        list(v_layout.ints()),
        coded,
        kv_len,
        q_pos,
        table,
    )


def attention_mixed(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    threads: int,
    codes: mx.array,
    layouts,
    kv_len,
    q_pos,
    table,
    classes,
) -> mx.array:
    """Attention over a pool's chunks of mixed widths, lazily (kernels/cpu/attention.cpp
    mf_attention_mixed): block i of row b is float chunk table[b, i] of the pool k, v [slots, Hkv,
    block_tokens, hd] where classes[b, i] is 0, else coded chunk table[b, i] read through layouts[c - 1]
    (a (keys, values) pair of kernels/kv_codes.py CodedLayout over the uint8 buffer `codes`)."""
    return extension().attention_mixed(
        q, k, v, float(scale), max(int(threads), 1), codes, pairs_ints(tuple(layouts)), kv_len, q_pos, table, classes
    )
