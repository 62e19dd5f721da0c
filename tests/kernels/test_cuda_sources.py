"""The CUDA sources compile where no GPU is: every kernels/cuda/*.cu with nvcc for sm_89 (RTX 4090)
and sm_90 (H100) with warnings as errors, and the torch binding's C++ against torch's headers. A
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
    assert SOURCES == ["sparse_ffn.cu"]


def cuda_top() -> str:
    """The CUDA toolkit's root as nvcc itself reports it (nvcc may be a wrapper script)."""
    r = subprocess.run([nvcc(), "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True,
                       text=True, timeout=60)
    m = re.search(r"^#\$ TOP=(.*)$", r.stdout + r.stderr, re.M)
    return os.path.realpath(m.group(1).strip()) if m else os.path.dirname(os.path.dirname(os.path.realpath(nvcc())))


@pytest.mark.parametrize("source", SOURCES)
def test_cu_compiles_for_sm89_and_sm90_without_warnings(source, tmp_path):
    cmd = [nvcc(), "-c", "-std=c++17", "-O3", *ARCHS, "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror",
           os.path.join(CUDA_DIR, source), "-o", str(tmp_path / "out.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    blob = (tmp_path / "out.o").read_bytes()  # the fatbinary names the architectures it holds code for
    assert b"sm_89" in blob and b"sm_90" in blob


def test_torch_binding_compiles(tmp_path):
    """sparse_ffn_torch.cpp against the installed torch's headers (C++ only: the binding takes the
    stream as an integer, so it needs no CUDA build of torch)."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    cuda_include = os.path.join(cuda_top(), "include")
    if not os.path.isfile(os.path.join(cuda_include, "cuda_runtime.h")):
        pytest.skip(f"no cuda_runtime.h beside nvcc ({cuda_include})")
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-Wall", "-Werror", "-DTORCH_EXTENSION_NAME=mf_check",
           *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
           f"-I{cuda_include}", os.path.join(CUDA_DIR, "sparse_ffn_torch.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
