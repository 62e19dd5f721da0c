"""The channel-major product (cpu/channel_major.cpp) from Python: a stored affine matrix rewritten once
into a layout where each input channel's codes for many outputs lie side by side (the same codes,
scales and biases, reordered; the scales' bytes as stored), then multiplied by rows of x skipping
every channel whose |x| is not above a threshold: TEAL-style activation sparsity, whose zeroed inputs
cost neither reads nor multiply-adds. A negative threshold gives the dense product in this layout.

Framework-neutral: numpy arrays in and out; `from_stored` takes a buffer factory, so the torch and
MLX backends can have the layout written into their own memory (torch_ops.TorchChannelMajor,
mlx_kernels.GraphChannelMajor multiply it inside their graphs). Plain-ops reference:
channel_major_ref.py."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import numpy as np

from mlx_flash.host_memory import anonymous_buffer
from mlx_flash.kernels.qmatmul import StoredMatrix, library

TILE = 256  # outputs the kernel's decode loop holds in registers per group (a thread's last tile narrower)
STEP = 64  # the layout's outputs are padded to a multiple of this (cpu/channel_major.h CM_STEP)
COUNTERS = ("rows", "active channels", "active groups")  # what the counters hold, in order
_REFUSALS = {
    -1: "bits must be 2, 4 or 8",
    -2: "the group size must be 32 .. 256 inputs in steps of 32",
    -3: "the matrix needs N, K >= 1 and K a multiple of the group size",
    -4: "scales must be float16, bfloat16 or float32",
    -5: "a laid-out matrix needs at least one row per block",
    -6: "a buffer is missing",
    -7: "x needs T >= 0 rows",
    -8: "the threshold must be a number (got NaN)",
    -9: "gate and up differ in shape, or gate|up has an odd number of outputs",
    -10: "down's inputs are not the activations' width F",
    -11: "act must be 0 (silu) or 1 (gelu, tanh approximation)",
}
ACTS = {"silu": 0, "gelu_tanh": 1}  # a gated FFN's activations, as mf_cm_gated_ffn numbers them


class CmArgs(ctypes.Structure):
    """A matrix as mf_cm_gated_ffn takes it (cpu/matrix_ref.h mf_cm_matrix)."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("n_out", ctypes.c_int64),
        ("k_in", ctypes.c_int64),
        ("bits", ctypes.c_int),
        ("group", ctypes.c_int),
        ("scale_type", ctypes.c_int),
    ]


_BOUND = False


def _lib() -> ctypes.CDLL:
    global _BOUND
    lib = library()
    if not _BOUND:
        i64, vp, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.mf_cm_bytes.argtypes, lib.mf_cm_bytes.restype = [i64, i64, i32, i32, i32], i64
        lib.mf_cm_relayout.argtypes = [vp, vp, vp, i32, i64, i64, i32, i32, vp, vp, i32]
        lib.mf_cm_relayout.restype = i32
        lib.mf_cm_matmul.argtypes = [vp, i64, i64, i32, i32, i32, vp, i64, ctypes.c_float, vp, i32, vp]
        lib.mf_cm_matmul.restype = i32
        f32, cm = ctypes.c_float, ctypes.POINTER(CmArgs)
        lib.mf_cm_gated_ffn.argtypes = [vp, i64, cm, cm, cm, f32, f32, i32, vp, vp, i32, vp, vp, vp]
        lib.mf_cm_gated_ffn.restype = i32
        _BOUND = True
    return lib


def refusal(code: int) -> str:
    """The kernel's reason for a negative return code."""
    return _REFUSALS.get(code, f"code {code}")


def cm_bytes(n_out: int, k_in: int, bits: int, group: int, scale_type: int) -> int:
    """Bytes of the layout of an n_out x k_in matrix (ValueError naming what the kernel refuses)."""
    size = _lib().mf_cm_bytes(n_out, k_in, bits, group, scale_type)
    if size < 0:
        raise ValueError(f"the channel-major layout refuses this matrix: {refusal(size)}")
    return size


class ChannelMajorMatrix:
    """A stored matrix in the channel-major layout: `matmul(x, threshold)` is x [T, K] (or [K]) times
    it with every channel of a row whose |x| is not above `threshold` taken as zero (negative: all).

    Each product adds to `counters` (int64 [3], this object's own unless one is passed): rows
    computed, active channels and active groups (both summed over rows); `zeroed_share` and
    `bytes_skipped` read them, and `channel_bytes` and `group_bytes` turn them into bytes read."""

    def __init__(self, buffer: np.ndarray, n_out: int, k_in: int, bits: int, group: int, scale_type: int):
        size = cm_bytes(n_out, k_in, bits, group, scale_type)
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous or buffer.size < size:
            raise ValueError(
                f"the layout needs a contiguous 1-D uint8 buffer of {size} bytes (got {buffer.dtype} {buffer.shape})"
            )
        self.buffer = buffer  # kept: the kernel reads its memory
        self.n_out, self.k_in, self.bits, self.group, self.scale_type = n_out, k_in, bits, group, scale_type
        self.nbytes = size
        padded = -(-n_out // STEP) * STEP
        self._channel_bytes = padded * bits // 8
        self._group_bytes = 2 * padded * (4 if scale_type == 2 else 2)
        if size != (k_in // group) * (group * self._channel_bytes + self._group_bytes):
            raise RuntimeError("the kernel library's channel-major layout is not the one channel_major.py counts")
        self.counters = np.zeros(3, np.int64)
        self.spec = (n_out, k_in, bits, group, scale_type)  # the matrix as the framework operators take it
        self._call = _lib().mf_cm_matmul
        self._w = buffer.ctypes.data

    @property
    def channel_bytes(self) -> int:
        """Bytes of one input channel's codes in the layout (every output's, padding included): what
        a product reads for each active channel of a row."""
        return self._channel_bytes

    @property
    def group_bytes(self) -> int:
        """Bytes of one group's scales and biases in the layout: what a product reads for each group
        of a row with an active channel."""
        return self._group_bytes

    @classmethod
    def from_stored(
        cls, matrix: StoredMatrix, buffer_factory: Callable[[int], np.ndarray] | None = None, threads: int = 1
    ) -> "ChannelMajorMatrix":
        """`matrix` (rows are outputs; plain or laid out inside a store's bundles) rewritten into a
        buffer from buffer_factory(nbytes) (a writable uint8 numpy array, e.g. a framework's memory;
        default: page-aligned anonymous memory), on `threads` threads."""
        if not isinstance(matrix, StoredMatrix) or not matrix.rows_are_outputs:
            raise ValueError("the channel-major layout is made from a StoredMatrix whose rows are outputs")
        n, k, bits, group, st = matrix.n_out, matrix.k_in, matrix.bits, matrix.group, matrix.scale_type
        size = cm_bytes(n, k, bits, group, st)
        buffer = (buffer_factory or anonymous_buffer)(size)  # page-aligned: loads are whole lines
        if not isinstance(buffer, np.ndarray) or not buffer.flags.writeable:
            raise ValueError("buffer_factory must return a writable uint8 numpy array")
        out = cls(buffer, n, k, bits, group, st)
        codes, scales, biases = matrix.parts
        layout = matrix.layout
        rc = _lib().mf_cm_relayout(
            codes.ctypes.data,
            scales.ctypes.data,
            biases.ctypes.data,
            st,
            n,
            k,
            bits,
            group,
            None if layout is None else layout.ctypes.data,
            buffer.ctypes.data,
            max(int(threads), 1),
        )
        if rc != 0:
            raise ValueError(f"the channel-major relayout refused the matrix: {refusal(rc)}")
        return out

    def matmul(
        self,
        x: np.ndarray,
        threshold: float,
        out: np.ndarray | None = None,
        threads: int = 1,
        counters: np.ndarray | None = None,
    ) -> np.ndarray:
        """x [T, K] or [K] float32 (C-contiguous) -> [T, N] or [N] float32 (into `out` when given)."""
        if x.dtype != np.float32 or x.ndim not in (1, 2) or x.shape[-1] != self.k_in or not x.flags.c_contiguous:
            raise ValueError(
                f"x must be a contiguous float32 [T, {self.k_in}] or [{self.k_in}] (got {x.dtype} {x.shape})"
            )
        shape = (*x.shape[:-1], self.n_out)
        if out is None:
            out = np.empty(shape, np.float32)
        elif out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writable contiguous float32 {shape} (got {out.dtype} {out.shape})")
        threshold = float(threshold)
        if math.isnan(threshold):
            raise ValueError(refusal(-8))
        if counters is None:
            counters = self.counters
        elif counters.dtype != np.int64 or counters.shape != (3,) or not counters.flags.c_contiguous:
            raise ValueError(f"counters must be a contiguous int64 [3] (got {counters.dtype} {counters.shape})")
        T = x.shape[0] if x.ndim == 2 else 1
        n, k, bits, group, st = self.spec
        args = (self._w, n, k, bits, group, st, x.ctypes.data, T, threshold, out.ctypes.data, max(int(threads), 1))
        rc = self._call(*args, counters.ctypes.data)
        if rc != 0:
            raise ValueError(f"the channel-major kernel refused its arguments: {refusal(rc)}")
        return out

    def zeroed_share(self, counters: np.ndarray | None = None) -> float:
        """The share of inputs the products counted took as zero (0 before any product)."""
        rows, channels, _ = self.counters if counters is None else counters
        return 1.0 - channels / (rows * self.k_in) if rows else 0.0

    def bytes_skipped(self, counters: np.ndarray | None = None) -> int:
        """Bytes of the layout the products counted did not read: the codes of inactive channels and
        the scales and biases of groups without an active channel."""
        rows, channels, groups = (int(v) for v in (self.counters if counters is None else counters))
        idle_groups = rows * (self.k_in // self.group) - groups
        return (rows * self.k_in - channels) * self.channel_bytes + idle_groups * self.group_bytes


def gated_ffn(
    x: np.ndarray,
    gate_up: ChannelMajorMatrix,
    down: ChannelMajorMatrix,
    t_gu: float,
    t_down: float,
    up: ChannelMajorMatrix | None = None,
    act: str = "silu",
    threads: int = 1,
) -> np.ndarray:
    """down(act(gate) * up) of x [T, K] or [K] (float32, C-contiguous) in one call
    (cpu/channel_major_ffn.cpp): gate_up holds gate|up (2F outputs, gate first), or, with `up`, the gate
    alone; gate and up skip x's channels with |x| <= t_gu, down the activations' with |h| <= t_down
    (negative: none); each matrix's own counters count its products. Equal to the separate products
    and activation (matmul, the library's mf_silu_mul or mf_gelu_tanh_mul, matmul) to the bit."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {sorted(ACTS)} (got {act!r})")
    k = gate_up.k_in
    if x.dtype != np.float32 or x.ndim not in (1, 2) or x.shape[-1] != k or not x.flags.c_contiguous:
        raise ValueError(f"x must be a contiguous float32 [T, {k}] or [{k}] (got {x.dtype} {x.shape})")
    if math.isnan(float(t_gu)) or math.isnan(float(t_down)):
        raise ValueError("the thresholds must be numbers (got NaN)")
    T = x.shape[0] if x.ndim == 2 else 1
    f = gate_up.n_out if up is not None else gate_up.n_out // 2
    out = np.empty((*x.shape[:-1], down.n_out), np.float32)
    hidden = np.empty(max(2 * T * f, 1), np.float32)
    args = [None if m is None else ctypes.byref(CmArgs(m._w, *m.spec)) for m in (gate_up, up, down)]
    counters = [None if m is None else m.counters.ctypes.data for m in (gate_up, up, down)]
    rc = _lib().mf_cm_gated_ffn(
        x.ctypes.data,
        T,
        *args,
        t_gu,
        t_down,
        ACTS[act],
        hidden.ctypes.data,
        out.ctypes.data,
        max(int(threads), 1),
        *counters,
    )
    if rc != 0:
        raise ValueError(f"the channel-major gated FFN refused its arguments: {refusal(rc)}")
    return out
