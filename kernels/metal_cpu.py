"""Runs the bodies of Metal kernels (metal/*.metal, written for mx.fast.metal_kernel) on the CPU, so
that machines without an Apple GPU test them: the body is wrapped in the function MLX would
generate (inputs `const device T* name` with name_shape / name_strides / name_ndim where the body
names them, outputs `device T* name`, the thread attributes the body names, template parameters),
compiled with a C++ compiler against metal/msl_shim.h, loaded with ctypes and run over the grid
with real barrier and SIMD-group semantics (msl_shim.h explains how). Test tooling: nothing on the
per-token path imports it.

    k = metal_kernel("myexp", ["inp"], ["out"], "uint i = thread_position_in_grid.x; out[i] = metal::exp(inp[i]);")
    (y,) = k(inputs=[a], grid=(a.size, 1, 1), threadgroup=(32, 1, 1), output_shapes=[a.shape],
             output_dtypes=[np.float32])

takes the arguments mx.fast.metal_kernel and its kernels take (numpy arrays in and out, `seed`
added: the fiber schedule's), and run_metal_body is the same with dicts. Compiled libraries are
cached by a hash of their source in a temporary folder (MLX_FLASH_METAL_CPU_CACHE overrides it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from importlib import resources

import numpy as np

CXX_FLAGS = ["-std=c++17", "-O1", "-fPIC", "-shared", "-fno-strict-aliasing"]

# numpy dtype -> the type name MLX writes into the signature (get_type_string)
MSL_TYPES = {
    np.dtype(np.bool_): "bool",
    np.dtype(np.uint8): "uint8_t",
    np.dtype(np.uint16): "uint16_t",
    np.dtype(np.uint32): "uint32_t",
    np.dtype(np.uint64): "uint64_t",
    np.dtype(np.int8): "int8_t",
    np.dtype(np.int16): "int16_t",
    np.dtype(np.int32): "int32_t",
    np.dtype(np.int64): "int64_t",
    np.dtype(np.float16): "float16_t",
    np.dtype(np.float32): "float",
}

# The thread attributes MLX adds to the signature when the body's text contains their name (the
# same substring test, so a body gets here exactly the parameters it gets from MLX).
ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint",
    "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3",
    "grid_origin": None,
    "grid_size": None,
    "quadgroup_index_in_threadgroup": "uint",
    "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint",
    "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint",
    "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}

MAX_CONSTANT_SIZE = 8  # MLX passes inputs of fewer elements in the constant address space

# `threadgroup T name[N]...;` -> a static of the wrapper function (shared by the fibers of the one
# threadgroup that runs at a time), registered so the runtime poisons it before each threadgroup.
_TG_DECL = re.compile(r"\bthreadgroup\s+([A-Za-z_][\w:<>, ]*?)\s+([A-Za-z_]\w*)\s*((?:\[[^\]]+\])*)\s*;")


class MetalShimError(RuntimeError):
    """A body that does not compile, or a run that faulted or broke a synchronization rule."""


class ShimUnavailable(MetalShimError):
    """No C++ compiler here."""


def metal_text(name: str) -> str:
    """A file of the metal/ folder shipped in mlx_flash.kernels."""
    return resources.files("mlx_flash.kernels").joinpath("metal", name).read_text()


def _text(source: str) -> tuple[str, str]:
    """(text, name for #line): a file of metal/ when `source` is a bare file name, else the text."""
    if re.fullmatch(r"[\w.-]+\.(metal|h)", source):
        return metal_text(source), source
    return source, "source"


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise ShimUnavailable("no C++ compiler (g++, c++ or clang++) to run Metal bodies on the CPU")
    return cxx


def _cache_dir() -> str:
    d = os.environ.get("MLX_FLASH_METAL_CPU_CACHE") or os.path.join(
        tempfile.gettempdir(), f"mlx_flash-metal-cpu-{os.getuid() if hasattr(os, 'getuid') else 0}"
    )
    os.makedirs(d, exist_ok=True)
    return d


_libs: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()
_building: dict[str, threading.Lock] = {}
_run_lock = threading.Lock()


def _load(tu: str) -> ctypes.CDLL:
    """Compile (once per source, also across processes through the cache) and load a unit."""
    cxx = compiler()
    key = hashlib.sha256("\0".join([cxx, *CXX_FLAGS, tu]).encode()).hexdigest()[:24]
    with _lock:
        if key in _libs:
            return _libs[key]
        build_lock = _building.setdefault(key, threading.Lock())
    with build_lock:
        if key not in _libs:
            so = os.path.join(_cache_dir(), f"{key}.so")
            if not os.path.exists(so):  # built under names of this thread's own, then renamed (atomic)
                src, mine = os.path.join(_cache_dir(), f"{key}.cpp"), f".{os.getpid()}.{threading.get_ident()}"
                with open(src + mine, "w") as f:
                    f.write(tu)
                os.replace(src + mine, src)
                r = subprocess.run([cxx, *CXX_FLAGS, "-o", so + mine, src], check=False, capture_output=True, text=True)
                if r.returncode:
                    raise MetalShimError(f"{src} does not compile:\n{r.stderr[-6000:]}")
                os.replace(so + mine, so)
            lib = ctypes.CDLL(so)
            lib.mf_alloc.restype = ctypes.c_void_p
            lib.mf_alloc.argtypes = [ctypes.c_size_t]
            lib.mf_protect.argtypes = lib.mf_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.mf_launch.restype = ctypes.c_int
            _libs[key] = lib
    return _libs[key]


def _template_value(v) -> tuple[str, str]:
    """(C++ template parameter kind, value) of an MLX template argument: int, bool or a dtype."""
    if isinstance(v, (bool, np.bool_)):
        return "bool", "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return "int", str(int(v))
    return "typename", MSL_TYPES[np.dtype(v)]


class CpuMetalKernel:
    """mx.fast.metal_kernel's object, run on the CPU (numpy arrays in and out)."""

    def __init__(
        self, name, input_names, output_names, source, header="", ensure_row_contiguous=True, atomic_outputs=False
    ):
        if atomic_outputs:
            raise MetalShimError("atomic outputs are not emulated")
        if not output_names:
            raise MetalShimError("[metal_kernel] Must specify at least one output.")
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        (self.source, self.source_name), (self.header, self.header_name) = _text(source), _text(header)
        self.ensure_row_contiguous = ensure_row_contiguous
        # as MLX: shape / strides / ndim buffers where the body names them, attributes likewise
        self.shape_info = [
            tuple(f"{n}_{k}" in self.source for k in ("shape", "strides", "ndim")) for n in self.input_names
        ]
        self.attributes = [a for a in ATTRIBUTES if a in self.source]
        bad = [a for a in self.attributes if ATTRIBUTES[a] is None]
        if bad:
            raise MetalShimError(f"{name}: the shim does not provide {', '.join(bad)}")

    def signature(self, inputs, output_dtypes) -> tuple[list[str], list[str]]:
        """The parameters MLX declares for these inputs and output dtypes (without the [[...]]
        attributes), and the launcher's argument for each."""
        params, args = [], []
        for i, (n, a) in enumerate(zip(self.input_names, inputs)):
            t = MSL_TYPES[a.dtype]
            if a.ndim == 0:
                params.append(f"const constant {t}& {n}")
                args.append(f"*(const {t}*)a.data[{i}]")
                continue
            space = "constant" if a.size < MAX_CONSTANT_SIZE else "device"
            params.append(f"const {space} {t}* {n}")
            args.append(f"(const {t}*)a.data[{i}]")
            has_shape, has_strides, has_ndim = self.shape_info[i]
            if has_shape:
                params.append(f"const constant int* {n}_shape")
                args.append(f"a.shapes[{i}]")
            if has_strides:
                params.append(f"const constant int64_t* {n}_strides")
                args.append(f"a.strides[{i}]")
            if has_ndim:
                params.append(f"const constant int& {n}_ndim")
                args.append(f"a.ndims[{i}]")
        for k, (n, dt) in enumerate(zip(self.output_names, output_dtypes)):
            t = MSL_TYPES[np.dtype(dt)]
            params.append(f"device {t}* {n}")
            args.append(f"({t}*)a.data[{len(inputs) + k}]")
        for attr in self.attributes:
            params.append(f"{ATTRIBUTES[attr]} {attr}")
            args.append(f"id.{attr}")
        return params, args

    def unit(self, inputs, output_dtypes, template=()) -> str:
        """The C++ translation unit of this body for these input/output dtypes and template."""
        params, args = self.signature(inputs, output_dtypes)
        tmpl = [(n, *_template_value(v)) for n, v in template]
        head = f"template <{', '.join(f'{k} {n}' for n, k, _ in tmpl)}>\n" if tmpl else ""
        inst = f"<{', '.join(v for _, _, v in tmpl)}>" if tmpl else ""

        def tg(text):
            return _TG_DECL.sub(
                lambda m: f"static {m[1]} {m[2]}{m[3]}; mf::register_region(&{m[2]}, sizeof({m[2]}));", text
            )

        sep = ",\n    "
        return (
            f'#line 1 "msl_shim.h"\n{metal_text("msl_shim.h")}\n'
            f'#line 1 "{self.header_name}"\n{tg(self.header)}\n'
            f'#line 1 "generated signature"\n{head}static void kernel_{self.name}(\n    {sep.join(params)}) {{\n'
            f'#line 1 "{self.source_name}"\n{tg(self.source)}\n}}\n\n'
            '#line 1 "generated launcher"\n'
            "namespace {\nstruct Args {\n  void* const* data;\n  const int* const* shapes;\n"
            "  const int64_t* const* strides;\n  const int* ndims;\n};\n"
            "void call(void* closure, const mf::Ids& id) {\n  const Args& a = *(const Args*)closure;\n"
            f"  (void)id;\n  kernel_{self.name}{inst}(\n    {sep.join(args)});\n}}\n}}  // namespace\n\n"
            'extern "C" int mf_launch(void* const* data, const int* const* shapes, const int64_t* const* strides,\n'
            "                         const int* ndims, const unsigned* grid, const unsigned* tg,\n"
            "                         unsigned long long seed, char* err, int errlen, uintptr_t* fault) {\n"
            "  Args a{data, shapes, strides, ndims};\n"
            "  return mf::launch(grid, tg, seed, call, &a, err, errlen, fault);\n}\n"
        )

    def _prepared(self, inputs):
        inputs = [np.asarray(a) for a in inputs]
        if len(inputs) != len(self.input_names):
            raise MetalShimError(
                f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} but got size {len(inputs)}."
            )
        return [np.ascontiguousarray(a) if self.ensure_row_contiguous else a for a in inputs]

    def build(self, inputs, output_dtypes, template=()) -> ctypes.CDLL:
        """Compile without running (tests build many variants at once on several cores)."""
        return _load(self.unit(self._prepared(inputs), output_dtypes, template))

    def __call__(
        self,
        *,
        inputs,
        grid,
        threadgroup,
        output_shapes,
        output_dtypes,
        template=(),
        init_value=None,
        verbose=False,
        seed=0,
    ):
        inputs = self._prepared(inputs)
        if not self.ensure_row_contiguous and any(not a.flags.c_contiguous for a in inputs):
            raise MetalShimError("non-contiguous inputs need ensure_row_contiguous=True here")
        if len(output_shapes) != len(self.output_names) or len(output_dtypes) != len(self.output_names):
            raise MetalShimError("[metal_kernel] Expected one output shape and dtype per output name.")
        tu = self.unit(inputs, output_dtypes, template)
        if verbose:
            print(tu)
        lib = _load(tu)
        with _run_lock:  # the runtime's state is one per library
            bufs = []  # (name, address, nbytes, is_input), unmapped whatever happens
            try:
                return self._launch(
                    lib, bufs, inputs, output_shapes, output_dtypes, grid, threadgroup, init_value, seed
                )
            finally:
                for _, p, nbytes, _ in bufs:
                    lib.mf_free(p, nbytes)

    def _launch(self, lib, bufs, inputs, output_shapes, output_dtypes, grid, threadgroup, init_value, seed):
        def alloc(name, nbytes, is_input):
            p = lib.mf_alloc(nbytes)
            if p is None:
                raise MemoryError(f"cannot map {nbytes} bytes for '{name}'")
            bufs.append((name, p, nbytes, is_input))
            return p

        views = []
        for n, a in zip(self.input_names, inputs):
            p = alloc(n, a.nbytes, True)
            ctypes.memmove(p, a.ctypes.data, a.nbytes)
            lib.mf_protect(p, a.nbytes)
        for n, shape, dt in zip(self.output_names, output_shapes, output_dtypes):
            dt = np.dtype(dt)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            p = alloc(n, nbytes, False)
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(p)) if nbytes else np.empty(0, np.uint8)
            out = raw.view(dt).reshape(shape)
            if init_value is None:
                out.view(np.uint8).reshape(-1)[:] = 0xFF  # uninitialized, as on the GPU: NaN for floats
            else:
                out[...] = init_value
            views.append(out)
        n_in = len(inputs)
        shapes = [(ctypes.c_int * max(a.ndim, 1))(*a.shape) for a in inputs]
        strides = [(ctypes.c_int64 * max(a.ndim, 1))(*(s // a.itemsize for s in a.strides)) for a in inputs]
        data = (ctypes.c_void_p * len(bufs))(*(p for _, p, _, _ in bufs))
        shape_p = (ctypes.POINTER(ctypes.c_int) * max(n_in, 1))(*shapes)
        stride_p = (ctypes.POINTER(ctypes.c_int64) * max(n_in, 1))(*strides)
        ndims = (ctypes.c_int * max(n_in, 1))(*(a.ndim for a in inputs))
        err = ctypes.create_string_buffer(1024)
        fault = ctypes.c_size_t(0)
        rc = lib.mf_launch(
            data,
            shape_p,
            stride_p,
            ndims,
            (ctypes.c_uint * 3)(*grid),
            (ctypes.c_uint * 3)(*threadgroup),
            ctypes.c_ulonglong(seed),
            err,
            1024,
            ctypes.byref(fault),
        )
        if rc == 2:
            raise MetalShimError(f"{self.name}: {_fault_message(fault.value, bufs)}")
        if rc:
            raise MetalShimError(f"{self.name}: {err.value.decode()}")
        return [v.copy() for v in views]


def _fault_message(addr: int, bufs) -> str:
    page = os.sysconf("SC_PAGE_SIZE")
    for name, p, nbytes, is_input in bufs:
        if p <= addr < p + nbytes and is_input:
            return f"store into input '{name}' (byte {addr - p} of {nbytes}); inputs are read-only"
        if p + nbytes <= addr < p + nbytes + page:
            return f"access past the end of '{name}' (byte {addr - p} of a {nbytes}-byte buffer)"
    return f"memory fault at {addr:#x}, outside every buffer (a stray index, or a thread's stack overflowed)"


def metal_kernel(
    name, input_names, output_names, source, header="", ensure_row_contiguous=True, atomic_outputs=False
) -> CpuMetalKernel:
    """mx.fast.metal_kernel, run on the CPU: same arguments (source/header may also name a file of
    metal/), and its kernels take the same call arguments with numpy arrays."""
    return CpuMetalKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs)


def run_metal_body(
    source,
    inputs: dict,
    outputs: dict,
    template=(),
    grid=(1, 1, 1),
    threadgroup=(1, 1, 1),
    header="",
    seed=0,
    name="body",
) -> dict:
    """One run of a body: inputs {name: array}, outputs {name: (shape, dtype, init value or None)}
    -> {name: array}."""
    k = metal_kernel(name, list(inputs), list(outputs), source, header)
    outs = k(
        inputs=list(inputs.values()),
        grid=grid,
        threadgroup=threadgroup,
        template=template,
        seed=seed,
        output_shapes=[o[0] for o in outputs.values()],
        output_dtypes=[o[1] for o in outputs.values()],
        init_value=_one_init(outputs),
    )
    return dict(zip(outputs, outs))


def _one_init(outputs: dict):
    inits = {o[2] for o in outputs.values()}
    if len(inits) > 1:  # mx.fast.metal_kernel takes one init_value for all outputs
        raise MetalShimError("one init value for every output, as mx.fast.metal_kernel takes")
    return inits.pop()
