"""The CUDA sources compile where no GPU is: every kernels/cuda/*.cu with nvcc for sm_89 (RTX 4090)
and sm_90 (H100) with warnings as errors, and the torch bindings' C++ against torch's headers. A
machine without nvcc skips, unless MLX_FLASH_REQUIRE_NVCC=1 (CI), where that is a failure."""

import os
import re
import shutil
import subprocess
import sysconfig

import pytest

CUDA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels", "cuda")
SOURCES = sorted(f for f in os.listdir(CUDA_DIR) if f.endswith(".cu"))
ARCHS = ("-gencode=arch=compute_89,code=sm_89", "-gencode=arch=compute_90,code=sm_90")


def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        if os.environ.get("MLX_FLASH_REQUIRE_NVCC") == "1":
            pytest.fail("nvcc is not on PATH (MLX_FLASH_REQUIRE_NVCC=1)")
        pytest.skip("nvcc is not on PATH")
    return path


def test_there_are_sources():
    assert SOURCES == ["qmatmul.cu", "sparse_ffn.cu"]


def cuda_top() -> str:
    """The CUDA toolkit's root as nvcc itself reports it (nvcc may be a wrapper script)."""
    r = subprocess.run(
        [nvcc(), "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True, text=True, timeout=60
    )
    m = re.search(r"^#\$ TOP=(.*)$", r.stdout + r.stderr, re.M)
    return os.path.realpath(m.group(1).strip()) if m else os.path.dirname(os.path.dirname(os.path.realpath(nvcc())))


@pytest.mark.parametrize("source", SOURCES)
def test_cu_compiles_for_sm89_and_sm90_without_warnings(source, tmp_path):
    cmd = [
        nvcc(),
        "-c",
        "-std=c++17",
        "-O3",
        *ARCHS,
        "-Werror",
        "all-warnings",
        "-Xcompiler",
        "-Wall,-Wextra,-Werror",
        os.path.join(CUDA_DIR, source),
        "-o",
        str(tmp_path / "out.o"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    blob = (tmp_path / "out.o").read_bytes()  # the fatbinary names the architectures it holds code for
    assert b"sm_89" in blob and b"sm_90" in blob


# ~20 s for sparse_ffn_torch.cpp (torch's headers parsed again): the default tier checks ops_cuda.cpp
@pytest.mark.parametrize("binding", [pytest.param("sparse_ffn_torch.cpp", marks=pytest.mark.full), "ops_cuda.cpp"])
def test_torch_binding_compiles(binding, tmp_path):
    """The bindings against the installed torch's headers (C++ only). sparse_ffn_torch.cpp takes the
    stream as an integer; ops_cuda.cpp asks c10/cuda for it, headers a CPU build of torch ships too
    but for the one its CMake generates (cuda_cmake_macros.h), written here as CUDA builds have it."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    cuda_include = os.path.join(cuda_top(), "include")
    if not os.path.isfile(os.path.join(cuda_include, "cuda_runtime.h")):
        pytest.skip(f"no cuda_runtime.h beside nvcc ({cuda_include})")
    macros = os.path.join("c10", "cuda", "impl", "cuda_cmake_macros.h")
    if not any(os.path.isfile(os.path.join(p, macros)) for p in cpp_extension.include_paths()):
        (tmp_path / macros).parent.mkdir(parents=True)
        (tmp_path / macros).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [
        "g++",
        "-std=c++20",
        "-fsyntax-only",
        "-Wall",
        "-Werror",
        "-DTORCH_EXTENSION_NAME=mf_check",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{cuda_include}",
        f"-I{tmp_path}",
        f"-I{os.path.join(CUDA_DIR, '..', 'torch')}",  # check_text.h, shared with the CPU operators
        os.path.join(CUDA_DIR, binding),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
