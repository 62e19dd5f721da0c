"""The CPU kernels as torch operators (torch.ops.mlx_flash.*, kernels/torch/ops.cpp): built with
torch.utils.cpp_extension at first use beside the installed package (mlx_flash/kernels/torch_build/
<hash>, one build per torch version shared by every cache directory), or, where that folder is not
writable, into the cache (MLX_FLASH_CACHE or ~/.cache/mlx_flash, torch_ops/<hash>); one process
builds while others wait on a lock, with a line saying so (extension_build.py); then loaded once per
process. load() starts the build in a child process ahead of its use (build_in_background), so that
it runs while the model converts. Fake implementations are registered so torch.compile can trace
them. Nothing falls back silently: when the build fails, KernelUnavailableError says why in one
line. torch is imported only here and by the torch backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from importlib import metadata

import numpy as np

from mlx_flash.config import default_cache_dir

from . import qmatmul
from .channel_major import ACTS
from .extension_build import build, folder, is_built
from .qmatmul import Arith
from .stored_operands import one_buffer, operands, layer_specs

SOURCES = (
    ("torch", "ops.cpp"),
    ("torch", "check_text.h"),
    ("torch", "moe_table.h"),
    ("cpu", "kernel_table.h"),
    ("cpu", "matrix_ref.h"),
    ("cpu", "kv_codes.h"),
)  # (folder, file) of the shipped kernels
_OPS = None


def _build_root() -> str:
    """Beside the package when it may be written there, else the user's cache."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.access(here, os.W_OK):
        return os.path.join(here, "torch_build")
    return os.path.join(default_cache_dir(), "torch_ops")


WHAT = "the torch operators of mlx_flash's CPU kernels"
NOTE = "once per torch version; about 20 s"
# ops.cpp is glue: it checks arguments and calls the kernels, which are compiled (at -O3) into
# _qmatmul. Most of its build is the compiler reading torch's headers, and -O1 takes a third off the
# rest (17 s against 25 s on one core), on the path of a fresh install's first answer.
CFLAGS = ("-O1",)


def _torch_version() -> str | None:
    """The installed torch's version, read from its metadata (importing torch takes seconds); None
    where it has none."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _salt(version: str) -> str:
    return f"torch {version} {sys.version} {' '.join(CFLAGS)}"


def _build(root: str, load: bool):
    version = _torch_version()
    if version is None:  # a torch without metadata (a source tree on the path): ask torch itself
        import torch

        version = torch.__version__
    return build(
        WHAT,
        "mf_torch_ops",
        root,
        SOURCES,
        ["ops.cpp"],
        _salt(version),
        cflags=CFLAGS,
        python_module=False,
        note=NOTE,
        load=load,
    )


def build_in_background(progress: bool) -> None:
    """Start building the operators in a child process when torch is installed and they are not built
    yet, so that the build (one core for 15 s, most of it the compiler reading torch's headers)
    overlaps what the caller does meanwhile: converting a model, importing torch. ops() then waits on
    the build's lock and loads what the child built; when the child failed, ops() builds again and
    names the compiler's error. A thread waits for the child, so no process is left unreaped."""
    version, root = _torch_version(), _build_root()
    if version is None or is_built(folder(root, SOURCES, _salt(version))[0]):
        return
    if progress:
        print(f"building {WHAT} in the background ({NOTE})", file=sys.stderr, flush=True)
    child = [sys.executable, "-c", f"from mlx_flash.kernels import torch_ops; torch_ops.build_ahead({root!r})"]
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    threading.Thread(target=subprocess.run, args=(child,), kwargs=quiet, daemon=True, name="torch-ops-build").start()


def build_ahead(root: str) -> None:
    """The child's work (build_in_background): build into `root` unless built there; load nothing."""
    _build(root, load=False)


def ops():
    """torch.ops.mlx_flash, built on first use (then loaded from the cache) and bound to the CPU kernel
    library this process loaded."""
    global _OPS
    if _OPS is not None:
        return _OPS
    import torch

    _build(_build_root(), load=True)
    torch.ops.mlx_flash.use_kernel_library(qmatmul.library_path())
    _register_fakes(torch)
    _OPS = torch.ops.mlx_flash
    return _OPS


def _register_fakes(torch) -> None:
    """Shapes and dtypes of each operator's result without computing it (torch.compile's tracing)."""
    lib = "mlx_flash::"

    @torch.library.register_fake(lib + "stored_matmul")
    def _(
        x,
        buffer,
        kind,
        w_off,
        s_off,
        b_off,
        scale_type,
        bits,
        group,
        n_out,
        transposed,
        layout,
        threads,
        ids=None,
        listed=0,
        arith=0,
    ):
        return x.new_empty((*x.shape[:-1], n_out))

    @torch.library.register_fake(lib + "stored_rows")
    def _(ids, buffer, kind, w_off, s_off, b_off, scale_type, bits, group, rows, k, row_bytes, scale_row_bytes):
        return buffer.new_empty((*ids.shape, k), dtype=torch.float32)

    @torch.library.register_fake(lib + "attention")
    def _(q, k, v, scale, threads, kv_len=None, q_pos=None, table=None, window=0):
        B, Hq, T, hd = q.shape
        return q.new_empty((B, T, Hq, hd)).transpose(1, 2)

    @torch.library.register_fake(lib + "attention_coded")
    def _(q, k, v, scale, threads, k_codes, k_layout, v_codes, v_layout, coded, kv_len, q_pos, table=None):
        B, Hq, T, hd = q.shape
        return q.new_empty((B, T, Hq, hd)).transpose(1, 2)

    @torch.library.register_fake(lib + "attention_mixed")
    def _(q, k, v, scale, threads, codes, layouts, kv_len, q_pos, table, classes):
        B, Hq, T, hd = q.shape
        return q.new_empty((B, T, Hq, hd)).transpose(1, 2)

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, w, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "rope")
    def _(x, inv_freq, pos, dims, traditional, scale):
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "silu_mul")
    def _(g, u):
        return g.new_empty(g.shape)

    @torch.library.register_fake(lib + "gated_ffn")
    def _(x, gate_buffer, gate, up_buffer, up, down_buffer, down, threads, ids=None, listed=()):
        return x.new_empty((*x.shape[:-1], down[7]))

    @torch.library.register_fake(lib + "moe_experts")
    def _(x, ids, weights, sum, buffers, table, threads):
        return torch.empty_like(sum, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "cm_matmul")
    def _(x, buffer, spec, threshold, threads, counters=None):
        return x.new_empty((*x.shape[:-1], spec[1]))

    @torch.library.register_fake(lib + "cm_gated_ffn")
    def _(x, gate_buffer, gate, up_buffer, up, down_buffer, down, t_gu, t_down, act, threads, *counters):
        return x.new_empty((*x.shape[:-1], down[1]))


def moe_experts(x, ids, weights, total, experts: dict, n_experts: int, threads: int):
    """total + every routed expert's gated FFN of its tokens times their router weights, experts
    ascending, in one operator call (kernels/cpu/moe_experts.cpp): x [N, D] float32, ids int32 and
    weights float32 [N, K], total [N, Dout]; experts: id -> (gate, up or None, down) TorchMatrix (or, on
    CUDA, cuda_ops.CudaMatrix: each has `buffer` and `spec`) of the experts in this call (a routed one
    not among them adds nothing)."""
    buffers, index, table = [], {}, []
    for e in range(n_experts):
        if e not in experts:
            table.append(0)
            continue
        table.append(1)
        for m in experts[e]:
            if m is None:
                table += [-1, 0]
                continue
            if id(m.buffer) not in index:
                index[id(m.buffer)] = len(buffers)
                buffers.append(m.buffer)
            table += [index[id(m.buffer)], len(m.spec), *m.spec]
    return ops().moe_experts(x, ids, weights, total, buffers, table, max(int(threads), 1))


def framework_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` of memory torch allocated, page-aligned, as a writable uint8 numpy view sharing it
    (what the reader pool fills); the view keeps the tensor alive."""
    import torch

    t = torch.empty(max(int(nbytes), 1) + 4096, dtype=torch.uint8)
    start = (-t.data_ptr()) % 4096
    return t[start : start + nbytes].numpy()


def tensor_of(view: np.ndarray):
    """(the torch tensor whose memory `view` lies in, view's byte offset in it), or None when the
    memory is not torch's."""
    import torch

    a = view
    while isinstance(a.base, np.ndarray):
        a = a.base
    if not isinstance(a.base, torch.Tensor):
        return None
    t = a.base
    return t, view.ctypes.data - t.data_ptr()


class TorchMatrix:
    """A StoredMatrix or BlockMatrix as a torch operator call: `__call__(x)` is x [.., K] times it;
    `rows(ids)` rows of a plain matrix as float32 [..ids, K] (embedding lookups)."""

    def __init__(self, matrix, threads: int, arith: Arith = Arith.EXACT):
        import torch

        self.ops, self.threads = ops(), max(int(threads), 1)
        self.op = operands(matrix)
        self.arith = self.op.arithmetic(arith)  # what its products compute (q8 where the kernels read it)
        found = [tensor_of(v) for v in self.op.views]
        if all(f is not None and f[0] is found[0][0] for f in found):
            t = found[0][0]
            self.buffer, offsets = t.reshape(-1).view(torch.uint8), [f[1] for f in found]
        else:
            buf, offsets, _ = one_buffer(self.op.views)  # shared memory, or a private copy of separate arrays
            self.buffer = torch.from_numpy(buf)
        self.offsets = tuple(offsets) + (0,) * (3 - len(offsets))
        self.n_out, self.k_in = self.op.n_out, self.op.k_in
        self.spec = self.op.spec(self.offsets, self.arith)  # the matrix as whole-layer operators take it
        first = self.op.views[0]  # rows, K, bytes a row, bytes a row of scales: what rows() reads
        self.row_geometry = (
            first.shape[0],
            self.k_in,
            first.strides[0],
            self.op.views[1].strides[0] if self.op.kind == 0 else 0,
        )
        self.matrix = matrix  # kept alive: its views are what the offsets point into

    def __call__(self, x):
        w, s, b = self.offsets
        st, bits, group = self.op.quant
        return self.ops.stored_matmul(
            x,
            self.buffer,
            self.op.kind,
            w,
            s,
            b,
            st,
            bits,
            group,
            self.n_out,
            self.op.transposed,
            self.op.layout,
            self.threads,
            None,
            0,
            int(self.arith),
        )

    def sparse(self, x, ids, n: int):
        """The product over n listed units (StoredMatrix.sparse's meaning; ids an int32 tensor, each
        checked by the caller to lie in range)."""
        w, s, b = self.offsets
        st, bits, group = self.op.quant
        n_out, listed = self.op.sparse_output(n)
        return self.ops.stored_matmul(
            x,
            self.buffer,
            self.op.kind,
            w,
            s,
            b,
            st,
            bits,
            group,
            n_out,
            self.op.transposed,
            self.op.layout,
            self.threads,
            ids,
            int(listed),
            int(self.arith),
        )

    @staticmethod
    def gated_ffn(x, gate: "TorchMatrix", up: "TorchMatrix | None", down: "TorchMatrix", ids=None, n: int = 0):
        """down(silu(gate) * up) of x [.., K]; up None: gate is gate|up, one matrix of 2F outputs (gate
        first). With ids (an int32 tensor, each checked by the caller to lie in range): the sparse layer
        over n listed units of each matrix (StoredMatrix.sparse's meaning). The products and the
        activation in one operator call, identical to separate calls."""
        specs, listed = layer_specs((gate, up, down), n if ids is not None else None)
        return gate.ops.gated_ffn(
            x, gate.buffer, specs[0], (up or gate).buffer, specs[1], down.buffer, specs[2], gate.threads, ids, listed
        )

    def rows(self, ids):
        if self.op.layout and self.op.kind == 0:
            raise ValueError("rows are read from plain matrices (rows one after another), not laid-out ones")
        w, s, b = self.offsets
        st, bits, group = self.op.quant
        return self.ops.stored_rows(ids, self.buffer, self.op.kind, w, s, b, st, bits, group, *self.row_geometry)


class TorchChannelMajor:
    """A ChannelMajorMatrix as a torch operator call: `__call__(x, threshold)` is x [.., K] times it,
    a row's channels with |x| <= threshold taken as zero (negative: the dense product). The layout is
    read where it lies (torch memory when the matrix was made with framework_buffer, else the numpy
    memory shared without a copy); each thresholded product adds to the matrix's own counters
    (`counters`, a tensor sharing them), and each dense one (a negative threshold: prompts, several
    rows) to `dense_counters`, so the first say what the thresholds skipped."""

    def __init__(self, cm_matrix, threads: int):
        import torch

        self.ops, self.threads = ops(), max(int(threads), 1)
        found = tensor_of(cm_matrix.buffer)
        if found is None:
            self.buffer, self.offset = torch.from_numpy(cm_matrix.buffer), 0
        else:
            self.buffer, self.offset = found[0].reshape(-1).view(torch.uint8), found[1]
        self.counters = torch.from_numpy(cm_matrix.counters)
        self.dense_counters = torch.zeros(3, dtype=torch.int64)
        self.n_out, self.k_in = cm_matrix.n_out, cm_matrix.k_in
        self.spec = (self.offset, *cm_matrix.spec)  # the matrix as the operators take it
        self.matrix = cm_matrix  # kept alive: its buffer is what the offset points into
        # bound once: a decode step calls these for every product, and the overload's lookup and the
        # arguments' tuple each cost a little per call
        self._op, self._args = self.ops.cm_matmul.default, (self.buffer, self.spec)
        self._ffn = self.ops.cm_gated_ffn.default

    def __call__(self, x, threshold: float):
        counters = self.counters if threshold >= 0 else self.dense_counters
        return self._op(x, *self._args, threshold, self.threads, counters)


def cm_gated_ffn(x, gate_up: TorchChannelMajor, down: TorchChannelMajor, t_gu, t_down, up=None, act="silu"):
    """down(act(gate) * up) of x [.., K] in one operator call (kernels/cpu/channel_major_ffn.cpp):
    gate_up holds gate|up (2F outputs, gate first), or, with `up` (a TorchChannelMajor), the gate alone;
    gate and up skip the channels of x with |x| <= t_gu, down those of the activations with |h| <=
    t_down (negative: none). Each matrix counts as its own call would (thresholded products into
    `counters`, dense ones into `dense_counters`); the result equals those calls to the bit."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {sorted(ACTS)} (got {act!r})")
    g, d, u = gate_up, down, up or gate_up
    on = t_gu >= 0
    return g._ffn(
        x,
        *g._args,
        u.buffer,
        () if up is None else up.spec,
        *d._args,
        t_gu,
        t_down,
        ACTS[act],
        g.threads,
        g.counters if on else g.dense_counters,
        None if up is None else up.counters if on else up.dense_counters,
        d.counters if t_down >= 0 else d.dense_counters,
    )
