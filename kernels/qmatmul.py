"""The CPU quantized matmul (cpu/qmatmul.cpp) from Python: float32 activations times weights in the
store's affine layout (uint32-packed 4/8-bit codes, per-group scales and biases), computed on the
stored bytes with no dequantized copy. Framework-neutral: it takes numpy arrays, which may be views
of MLX or torch memory, and writes into a float32 output it allocates or is given.

The library is compiled at install (setup.py). A checkout whose library is missing or stale raises
KernelUnavailableError naming the fix; nothing falls back to another path silently.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
from enum import IntEnum

import numpy as np

from mlx_flash.errors import KernelUnavailableError


class Isa(IntEnum):
    """Code paths of the kernels, chosen at load from what the CPU reports (cpu/qmatmul.cpp). The
    float arithmetic has three (a VNNI level runs its width's float loops); the q8 arithmetic one per
    level (cpu/q8.h)."""

    PORTABLE = 0
    AVX2 = 1  # AVX2 + FMA + F16C
    AVX512 = 2  # AVX-512 F, BW, DQ, VL
    AVXVNNI = 3  # AVX2 with 256-bit VNNI (or AVX-512 VNNI's encoding of it)
    AVX512_VNNI = 4  # AVX-512 with VNNI

    @property
    def float_path(self) -> "Isa":
        """The float arithmetic's loops at this level."""
        return {Isa.AVXVNNI: Isa.AVX2, Isa.AVX512_VNNI: Isa.AVX512}.get(self, self)


class Arith(IntEnum):
    """The arithmetic of a product, as the kernels take it (cpu/q8.h): the float arithmetic (float32
    activations, float32 multiply-adds over the stored codes) or the q8 arithmetic (activations
    quantized to 8-bit codes with a scale per 8 inputs, integer dot products, scales applied in float)."""

    EXACT = 0
    Q8 = 1


ABI_VERSION = 10  # must equal mf_abi_version() of the compiled library
KERNEL_BITS = (2, 4, 8)  # widths whose codes do not straddle words (3 and 6 bits do; backends keep their own path)
_SCALE_TYPES = {np.dtype(np.float16): 0, np.dtype(np.float32): 2}  # bfloat16 travels as uint16 words: 1
_LIB = None
_LIB_PATH = ""
_QMATMUL = None  # the module function: the per-call entry (ctypes marshalling costs more than small products)


def library() -> ctypes.CDLL:
    """The loaded kernel library (loaded once per process)."""
    global _LIB, _LIB_PATH, _QMATMUL
    if _LIB is None:
        here = os.path.dirname(os.path.abspath(__file__))
        found = sorted(glob.glob(os.path.join(here, "_qmatmul*.so")) + glob.glob(os.path.join(here, "_qmatmul*.pyd")))
        if not found:
            raise KernelUnavailableError(
                f"{here}: the CPU kernel library (_qmatmul) is not built; reinstall the "
                "package (pip install -e . or make install) to compile it"
            )
        try:
            lib = ctypes.CDLL(found[0])
        except OSError as e:
            raise KernelUnavailableError(f"{found[0]}: cannot load the CPU kernel library ({e})") from None
        try:
            version = lib.mf_abi_version()
        except AttributeError:
            version = 0
        if version != ABI_VERSION:
            raise KernelUnavailableError(
                f"{found[0]}: the CPU kernel library is stale (version {version}, this "
                f"package needs {ABI_VERSION}); reinstall (pip install -e . or make install)"
            )
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        lib.mf_qmatmul.argtypes = [
            vp,
            i64,
            i64,
            vp,
            vp,
            vp,
            ctypes.c_int,
            i64,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            vp,
            ctypes.c_int,
            vp,
            vp,
            vp,
            ctypes.c_int,
        ]
        lib.mf_qmatmul.restype = ctypes.c_int
        lib.mf_cpu_isa.restype = ctypes.c_int
        lib.mf_set_isa.argtypes = [ctypes.c_int]
        lib.mf_set_isa.restype = ctypes.c_int
        lib.mf_can_run_isa.argtypes = [ctypes.c_int]
        lib.mf_can_run_isa.restype = ctypes.c_int
        lib.mf_q8_reads.argtypes = [ctypes.c_int] * 4
        lib.mf_q8_reads.restype = ctypes.c_int
        lib.mf_q8_quantize.argtypes = [vp, i64, i64, vp, vp, vp]
        lib.mf_q8_quantize.restype = ctypes.c_int
        _QMATMUL = importlib.import_module(__name__.rpartition(".")[0] + "._qmatmul").qmatmul
        _LIB, _LIB_PATH = lib, found[0]
    return _LIB


def library_path() -> str:
    """Where the loaded kernel library lies (the frameworks' operators call its functions from C++)."""
    library()
    return _LIB_PATH


def module_function(name: str):
    """A function of the compiled module (the per-call entries: qmatmul, blockmatmul)."""
    library()
    return getattr(importlib.import_module(__name__.rpartition(".")[0] + "._qmatmul"), name)


def cpu_isa() -> Isa:
    """The code path the kernel takes on this CPU."""
    return Isa(library().mf_cpu_isa())


def runnable_isas() -> list[Isa]:
    """Every level this CPU can run (tests force each)."""
    lib = library()
    return [isa for isa in Isa if lib.mf_can_run_isa(int(isa))]


def float_paths() -> list[Isa]:
    """The float arithmetic's distinct loops this CPU can run."""
    return sorted({isa.float_path for isa in runnable_isas()})


def q8_reads(kind: int, bits: int, group: int, rows_are_outputs: bool) -> bool:
    """Whether the q8 arithmetic multiplies a matrix (kind 0: affine `bits`-bit groups of `group`;
    else a GGUF block type): rows are outputs, and affine codes are 2, 4 or 8 bits in groups of a
    multiple of 32. Others (neuron-major down columns, 3- and 6-bit codes) run the float arithmetic
    whichever is asked."""
    return bool(library().mf_q8_reads(int(kind), int(bits), int(group), int(rows_are_outputs)))


def q8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] float32 as the q8 arithmetic quantizes it: (codes int8 [T, K] in natural order, scales
    float32 [T, K / 8] one per 8 inputs, block sums float32 [T, K / 32]); what q8_ref.quantize
    computes."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, K = x.shape
    if K % 32:
        raise ValueError(f"the q8 arithmetic quantizes rows in blocks of 32 (got {K} inputs)")
    q, d, s = np.empty((T, K), np.int8), np.empty((T, 4, K // 32), np.float32), np.empty((T, K // 32), np.float32)
    library().mf_q8_quantize(x.ctypes.data, T, K, q.ctypes.data, d.ctypes.data, s.ctypes.data)
    return q, d.transpose(0, 2, 1).reshape(T, K // 8), s


def use_isa(isa: Isa) -> Isa:
    """Force a code path (tests and benchmarks compare them); returns the previous one."""
    old = library().mf_set_isa(int(isa))
    if old < 0:
        raise KernelUnavailableError(f"this CPU cannot run the {Isa(isa).name} path (it runs {cpu_isa().name})")
    return Isa(old)


def _scale_type(a: np.ndarray, bf16: bool) -> int:
    if bf16:
        if a.dtype != np.uint16:
            raise ValueError(f"bfloat16 scales travel as uint16 words (got {a.dtype})")
        return 1
    if a.dtype not in _SCALE_TYPES:
        raise ValueError(f"scales must be float16, float32 or bfloat16 words (got {a.dtype})")
    return _SCALE_TYPES[a.dtype]


def _contiguous(a: np.ndarray, name: str) -> np.ndarray:
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (a copy here would defeat computing on the stored bytes)")
    return a


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words [R, C/(32/bits)] -> codes [R, C] (code j sits at bits*(j % per) of word j // per)."""
    per = 32 // bits
    shifts = bits * np.arange(per, dtype=np.uint32)
    codes = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


class StoredMatrix:
    """A stored quantized matrix, checked once when built and multiplied many times: per call only x
    is checked, so a decode step's hundred small products do not pay for validation.

    packed: uint32 words, [N, K/(32/bits)] when `rows_are_outputs` (a linear: y = x @ W^T) or
    [K, N/(32/bits)] otherwise (neuron-major: y = x @ W). scales, biases: [rows, packed-axis/group],
    float16, float32 or bfloat16 words (uint16, `bf16_scales`). The arrays are kept, not copied.

    Laid-out rows (rows_are_outputs only): packed a view [blocks, rows per block, groups, words per
    group] and scales, biases views [blocks, rows per block, groups] with any strides (biases with the
    scales' strides): row n = block * rows-per-block + r. The kernel reads them where they lie, e.g.
    inside the store's bundles (gate/up rows come in blocks of neurons; the down matrix's groups
    are its bundles), so a layer read from flash is multiplied without being unpacked.
    """

    def __init__(
        self,
        packed: np.ndarray,
        scales: np.ndarray,
        biases: np.ndarray,
        bits: int,
        group: int,
        rows_are_outputs: bool = True,
        bf16_scales: bool = False,
    ):
        if bits not in KERNEL_BITS:
            raise ValueError(f"bits must be one of {KERNEL_BITS} (got {bits})")
        if group <= 0 or group % 8:
            raise ValueError(f"group size must be a positive multiple of 8 (got {group})")
        self._layout = None
        self.sparse_axis, self.units = None, 0  # what sparse() lists (see there), and how many there are
        if packed.ndim == 4:
            packed, scales, biases = self._laid_out(packed, scales, biases, bits, group, rows_are_outputs)
        elif (
            not rows_are_outputs
            and packed.ndim == 2
            and not (packed.flags.c_contiguous and scales.flags.c_contiguous and biases.flags.c_contiguous)
        ):
            self._strided_inputs(packed, scales, biases, bits, group)
        if packed.dtype != np.uint32 or packed.ndim != 2:
            raise ValueError(f"packed weights must be 2-D uint32 (got {packed.dtype} {packed.shape})")
        rows, cols = packed.shape[0], packed.shape[1] * (32 // bits)
        if cols % group:
            raise ValueError(f"the packed axis ({cols}) is not a multiple of the group size {group}")
        for name, a in (("scales", scales), ("biases", biases)):
            if a.shape != (rows, cols // group):
                raise ValueError(f"{name} must be {(rows, cols // group)} (got {a.shape})")
            if self._layout is None:
                _contiguous(a, name)
        self.scale_type = _scale_type(scales, bf16_scales)
        if _scale_type(biases, bf16_scales) != self.scale_type:
            raise ValueError(f"scales and biases differ in type ({scales.dtype} vs {biases.dtype})")
        if self._layout is None:
            _contiguous(packed, "packed weights")
        self.arrays = (packed, scales, biases)  # kept alive: the kernel reads their memory
        self.bits, self.group, self.rows_are_outputs = bits, group, rows_are_outputs
        self.n_out, self.k_in = (rows, cols) if rows_are_outputs else (cols, rows)
        library()
        self._call = _QMATMUL
        # every argument but x, T, out and threads, in the module function's order
        self._w = (
            packed.ctypes.data,
            scales.ctypes.data,
            biases.ctypes.data,
            self.scale_type,
            self.n_out,
            self.bits,
            self.group,
            int(self.rows_are_outputs),
            0 if self._layout is None else self._layout.ctypes.data,
        )
        if self.sparse_axis is None and not rows_are_outputs:
            self.sparse_axis, self.units = "rows", self.k_in

    @property
    def parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, scales, biases) as the views the kernel starts reading at: the laid-out or strided
        views themselves where there are some, else the plain arrays."""
        return self._views if self._layout is not None else self.arrays

    @property
    def layout(self) -> np.ndarray | None:
        """The kernel's row layout (7 int64: rows per block, then the byte strides; see
        cpu/qmatmul.h), or None for a plain matrix."""
        return self._layout

    def _strided_inputs(self, packed, scales, biases, bits, group):
        """An input-row matrix (not rows_are_outputs) whose rows lie apart, e.g. the down columns of
        per-neuron bundles: [K, N/pack] words and [K, groups] scales/biases views, each row's words
        contiguous; row k at k * row stride."""
        if packed.dtype != np.uint32 or packed.strides[1] != 4:
            raise ValueError(
                f"packed rows must be uint32 with contiguous words (got {packed.dtype} strides {packed.strides})"
            )
        if biases.strides != scales.strides or biases.dtype != scales.dtype:
            raise ValueError("biases must lie like the scales (same strides and type)")
        if min(packed.strides + scales.strides) < 0:
            raise ValueError("strided rows must have non-negative strides")
        self._layout = np.array(
            [1, 0, packed.strides[0], group * bits // 8, 0, scales.strides[0], scales.strides[1]], dtype=np.int64
        )
        self._views = (packed, scales, biases)

    def _laid_out(self, packed, scales, biases, bits, group, rows_are_outputs):
        """Check laid-out views (see the class docstring) and record their strides for the kernel;
        returns 2-D stand-ins with the matrix's shape (for the checks shared with plain matrices; their
        first element is where the kernel starts)."""
        if not rows_are_outputs:
            raise ValueError("laid-out rows are for rows_are_outputs matrices only")
        if packed.dtype != np.uint32 or packed.strides[3] != 4 or packed.shape[3] * (32 // bits) != group:
            raise ValueError(
                f"packed view must be uint32 [blocks, rows, groups, {group * bits // 32}] with "
                f"contiguous words (got {packed.dtype} {packed.shape} strides {packed.strides})"
            )
        nb, rpb, groups = packed.shape[:3]
        for name, a in (("scales", scales), ("biases", biases)):
            if a.shape != (nb, rpb, groups):
                raise ValueError(f"{name} view must be {(nb, rpb, groups)} (got {a.shape})")
        if biases.strides != scales.strides or biases.dtype != scales.dtype:
            raise ValueError("biases must lie like the scales (same strides and type)")
        wb, wr, wg, _ = packed.strides
        sb, sr, sg = scales.strides
        if min(wb, wr, wg, sb, sr, sg) < 0:
            raise ValueError("laid-out views must have non-negative strides")
        self._layout = np.array([rpb, wb, wr, wg, sb, sr, sg], dtype=np.int64)
        self._views = (packed, scales, biases)  # what the stand-ins below point into: kept alive
        if rpb > 1 and wr < wg and wb == 0 and sr < sg:  # groups apart (a block store's down matrix)
            self.sparse_axis, self.units = "groups", groups
        else:
            self.sparse_axis, self.units = "blocks", nb
        rows = nb * rpb

        def stand_in(a, shape):
            return np.lib.stride_tricks.as_strided(a, shape=shape, strides=(0, 0), writeable=False)

        return (
            stand_in(packed, (rows, groups * packed.shape[3])),
            stand_in(scales, (rows, groups)),
            stand_in(biases, (rows, groups)),
        )

    def __call__(
        self, x: np.ndarray, threads: int = 1, out: np.ndarray | None = None, arith: Arith = Arith.EXACT
    ) -> np.ndarray:
        """x [T, K] float32 (C-contiguous) -> [T, N] float32 (into `out` when given), in `arith`. The
        kernel checks both buffers' type, contiguity and size (a ValueError names which)."""
        if x.ndim != 2 or x.shape[1] != self.k_in:
            raise ValueError(f"x must be [T, {self.k_in}] (got shape {x.shape})")
        T = x.shape[0]
        if out is None:
            out = np.empty((T, self.n_out), dtype=np.float32)
        elif out.shape != (T, self.n_out):
            raise ValueError(f"out must be [{T}, {self.n_out}] (got shape {out.shape})")
        self.into(x, T, out, threads, arith)
        return out

    def into(self, x, rows: int, out, threads: int = 1, arith: Arith = Arith.EXACT) -> None:
        """The product of `rows` input rows into `out`, for callers that hold buffers already shaped
        (any layout whose memory is [rows, K] and [rows, N] float32, C-contiguous). Only the kernel's
        own checks run: type, contiguity and size of both buffers."""
        w, s, b, st, n, bits, group, tr, lay = self._w
        th = threads if threads > 1 else 1
        self._call(x, rows, self.k_in, w, s, b, st, n, bits, group, tr, out, th, lay, 0, 0, int(arith))

    def sparse(
        self,
        x: np.ndarray,
        ids: np.ndarray,
        threads: int = 1,
        out: np.ndarray | None = None,
        arith: Arith = Arith.EXACT,
    ) -> np.ndarray:
        """The product over the listed units of a laid-out matrix only, in list order; ids int32 [n],
        each in [0, units):
          "blocks" (rows in blocks, e.g. gate rows of bundles): x [T, K] -> [T, n * rows per block]
          "groups" (groups apart, a block store's down matrix): x [T, n * group] -> [T, N]
          "rows"   (input rows, e.g. per-neuron down columns):  x [T, n] -> [T, N]
        n == 0 gives zeros (or an empty [T, 0] for blocks)."""
        if self.sparse_axis is None:
            raise ValueError("sparse products need a laid-out matrix (blocks, groups apart or strided input rows)")
        ids = np.asarray(ids)
        if ids.dtype != np.int32 or ids.ndim != 1 or not ids.flags.c_contiguous:
            raise ValueError(f"ids must be a contiguous 1-D int32 array (got {ids.dtype} {ids.shape})")
        n = ids.shape[0]
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.units):
            raise ValueError(f"ids must lie in [0, {self.units}) (got {int(ids.min())}..{int(ids.max())})")
        axis = self.sparse_axis
        rpb = int(self._layout[0]) if axis == "blocks" else 1
        k = self.k_in if axis == "blocks" else n * (self.group if axis == "groups" else 1)
        n_out = n * rpb if axis == "blocks" else self.n_out
        if x.ndim != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [T, {k}] for {n} {axis} (got shape {x.shape})")
        T = x.shape[0]
        if out is None:
            out = np.empty((T, n_out), dtype=np.float32)
        elif out.shape != (T, n_out):
            raise ValueError(f"out must be [{T}, {n_out}] (got shape {out.shape})")
        if n == 0 or T == 0:
            out[...] = 0
            return out
        w, s, b, st, _, bits, group, tr, lay = self._w
        rid, gid = (ids.ctypes.data, 0) if axis != "groups" else (0, ids.ctypes.data)
        th = threads if threads > 1 else 1
        self._call(x, T, k, w, s, b, st, n_out, bits, group, tr, out, th, lay, rid, gid, int(arith))
        return out


def qmatmul(
    x: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    group: int,
    transposed: bool = True,
    threads: int = 1,
    bf16_scales: bool = False,
    out: np.ndarray | None = None,
    arith: Arith = Arith.EXACT,
) -> np.ndarray:
    """One product x [T, K] @ W^T (W stored [N, K/(32/bits)] words, `transposed`) or @ W (W stored
    [K, N/...]); StoredMatrix when one matrix is multiplied many times."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be [T, K] (got shape {x.shape})")
    return StoredMatrix(packed, scales, biases, bits, group, transposed, bf16_scales)(x, threads, out, arith)
