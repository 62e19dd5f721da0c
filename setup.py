"""Package discovery: every subpackage of mlx_flash is found, so none can be forgotten, and the
top-level kernels/ folder (Metal/CUDA/C++ sources beside the package, see DESIGN.md) ships inside the
wheel as mlx_flash.kernels. The CPU kernel (kernels/cpu/*.cpp) is compiled here, at install, into
the extension module mlx_flash.kernels._qmatmul: its function qmatmul is the per-call entry, and
mlx_flash.kernels.qmatmul reaches its few other functions through ctypes. It needs no compiler after
install. Everything else is in pyproject.toml."""

import sys

from setuptools import Extension, find_packages, setup

# No -march/-m flags: the x86 paths carry target attributes and are chosen at run time from the CPU,
# so one build runs on AVX2-only and AVX-512 machines alike.
CXX_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden"] if sys.platform != "win32" else ["/O2", "/std:c++17"]

setup(
    packages=find_packages(include=["mlx_flash", "mlx_flash.*"]) + ["mlx_flash.kernels"],
    package_dir={"mlx_flash.kernels": "kernels"},
    ext_modules=[Extension("mlx_flash.kernels._qmatmul", language="c++", extra_compile_args=CXX_FLAGS,
                           sources=[f"kernels/cpu/{f}.cpp" for f in ("qmatmul", "qmatmul_portable", "qmatmul_avx2",
                                                                     "qmatmul_avx512", "blockmatmul", "blockmatmul_x86")],
                           depends=["kernels/cpu/qmatmul.h", "kernels/cpu/gguf_blocks.h"])],
)
