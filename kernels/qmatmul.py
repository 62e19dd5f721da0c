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
import os
from enum import IntEnum

import numpy as np

from mlx_flash.errors import KernelUnavailableError


class Isa(IntEnum):
    """Code paths of the kernel, chosen at load from what the CPU reports."""

    PORTABLE = 0
    AVX2 = 1  # AVX2 + FMA + F16C
    AVX512 = 2  # AVX-512 F + BW


ABI_VERSION = 1  # must equal mf_abi_version() of the compiled library
KERNEL_BITS = (2, 4, 8)  # widths whose codes do not straddle words (3 and 6 bits do; backends keep their own path)
_SCALE_TYPES = {np.dtype(np.float16): 0, np.dtype(np.float32): 2}  # bfloat16 travels as uint16 words: 1
_LIB = None


def library() -> ctypes.CDLL:
    """The loaded kernel library (loaded once per process)."""
    global _LIB
    if _LIB is None:
        here = os.path.dirname(os.path.abspath(__file__))
        found = sorted(glob.glob(os.path.join(here, "_qmatmul*.so")) + glob.glob(os.path.join(here, "_qmatmul*.pyd")))
        if not found:
            raise KernelUnavailableError(f"{here}: the CPU kernel library (_qmatmul) is not built; reinstall the "
                                         "package (pip install -e . or make install) to compile it")
        try:
            lib = ctypes.CDLL(found[0])
        except OSError as e:
            raise KernelUnavailableError(f"{found[0]}: cannot load the CPU kernel library ({e})") from None
        try:
            version = lib.mf_abi_version()
        except AttributeError:
            version = 0
        if version != ABI_VERSION:
            raise KernelUnavailableError(f"{found[0]}: the CPU kernel library is stale (version {version}, this "
                                         f"package needs {ABI_VERSION}); reinstall (pip install -e . or make install)")
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        lib.mf_qmatmul.argtypes = [vp, i64, i64, vp, vp, vp, ctypes.c_int, i64, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, vp, ctypes.c_int]
        lib.mf_qmatmul.restype = ctypes.c_int
        lib.mf_cpu_isa.restype = ctypes.c_int
        lib.mf_set_isa.argtypes = [ctypes.c_int]
        lib.mf_set_isa.restype = ctypes.c_int
        _LIB = lib
    return _LIB


def cpu_isa() -> Isa:
    """The code path the kernel takes on this CPU."""
    return Isa(library().mf_cpu_isa())


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


def dequantize_rows(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int,
                    bf16_scales: bool = False) -> np.ndarray:
    """Rows of a stored matrix as float32 (embedding lookups: a few rows, never a whole weight).
    q * scale is exact in float32 (<= 8-bit codes, <= 16-bit scales), so adding the bias rounds once,
    as MLX's dequantize does."""
    per = 32 // bits
    codes = (packed[..., None] >> (bits * np.arange(per, dtype=np.uint32))) & np.uint32((1 << bits) - 1)
    codes = codes.reshape(*packed.shape[:-1], -1, group).astype(np.float32)
    if bf16_scales:
        scales = (scales.astype(np.uint32) << 16).view(np.float32)
        biases = (biases.astype(np.uint32) << 16).view(np.float32)
    w = codes * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    return w.reshape(*packed.shape[:-1], -1)


def qmatmul(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int,
            transposed: bool = True, threads: int = 1, bf16_scales: bool = False,
            out: np.ndarray | None = None) -> np.ndarray:
    """x [T, K] float32 @ W^T (W stored [N, K/(32/bits)] words, `transposed`) or @ W (W stored [K, N/...]).

    scales, biases: [rows, packed-axis/group] float16, float32, or bfloat16 words (uint16, `bf16_scales`).
    threads: worker count (small problems use fewer). out: a float32 [T, N] array to write into.
    """
    if bits not in KERNEL_BITS:
        raise ValueError(f"bits must be one of {KERNEL_BITS} (got {bits})")
    if group <= 0 or group % 8:
        raise ValueError(f"group size must be a positive multiple of 8 (got {group})")
    x = _contiguous(np.asarray(x, dtype=np.float32) if x.dtype != np.float32 else x, "x")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, K] (got shape {x.shape})")
    if packed.dtype != np.uint32 or packed.ndim != 2:
        raise ValueError(f"packed weights must be 2-D uint32 (got {packed.dtype} {packed.shape})")
    T, K = x.shape
    rows, cols = packed.shape[0], packed.shape[1] * (32 // bits)
    N = rows if transposed else cols
    if (cols if transposed else rows) != K:
        raise ValueError(f"x has K={K} but the weights hold {cols if transposed else rows} inputs")
    if cols % group:
        raise ValueError(f"the packed axis ({cols}) is not a multiple of the group size {group}")
    for name, a in (("scales", scales), ("biases", biases)):
        if a.shape != (rows, cols // group):
            raise ValueError(f"{name} must be {(rows, cols // group)} (got {a.shape})")
        _contiguous(a, name)
    st = _scale_type(scales, bf16_scales)
    if _scale_type(biases, bf16_scales) != st:
        raise ValueError(f"scales and biases differ in type ({scales.dtype} vs {biases.dtype})")
    _contiguous(packed, "packed weights")
    if out is None:
        out = np.empty((T, N), dtype=np.float32)
    elif out.shape != (T, N) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous float32 {(T, N)} array")
    rc = library().mf_qmatmul(x.ctypes.data, T, K, packed.ctypes.data, scales.ctypes.data, biases.ctypes.data, st,
                              N, bits, group, int(transposed), out.ctypes.data, max(1, int(threads)))
    if rc != 0:
        raise ValueError(f"the CPU kernel refused its arguments (code {rc})")
    return out
