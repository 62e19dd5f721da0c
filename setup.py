"""Package discovery: every subpackage of mlx_flash is found, so none can be forgotten, and the
top-level kernels/ folder (Metal/CUDA/C++ sources beside the package, see DESIGN.md) ships inside the
wheel as mlx_flash.kernels. Two extensions are compiled here, at install:

- mlx_flash.kernels._qmatmul: the CPU kernels (kernels/cpu/*.cpp): quantized and GGUF block
  products, rows of stored matrices, attention. Its function qmatmul is the per-call entry of the
  numpy path; mlx_flash.kernels.qmatmul reaches the others through ctypes, and the frameworks'
  operators call them from C++.
- mlx_flash.kernels._mlx_kernels: those kernels as MLX primitives (kernels/mlx/, built with CMake
  against the MLX and nanobind pinned in pyproject.toml's build requirements: a C++ extension links
  one MLX version). When it cannot be built, the install goes on and the MLX backend on a CPU says
  so in one line at load.

Neither needs a compiler after install. Everything else is in pyproject.toml."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# No -march/-m flags: the x86 paths carry target attributes and are chosen at run time from the CPU,
# so one build runs on AVX2-only and AVX-512 machines alike. -g0 overrides the -g of Python's own
# flags: debug information took a fifth of these sources' compile time (68 s -> 54 s on one core),
# and a fresh install waits on it.
CXX_FLAGS = ["-O3", "-g0", "-std=c++17", "-fvisibility=hidden"] if sys.platform != "win32" else ["/O2", "/std:c++17"]
CPU_SOURCES = (
    "qmatmul",
    "qmatmul_portable",
    "qmatmul_avx2",
    "qmatmul_avx512",
    "blockmatmul",
    "blockmatmul_x86",
    "rows",
    "attention",
    "pointwise",
    "gated_ffn",
    "moe_experts",
    "q8_matmul",
    "q8_quantize",
    "q8_portable",
    "q8_avx512_vnni",
    "q8_avx512_bw",
    "q8_avx2",
    "q8_avxvnni",
    "q8_avxvnni_evex",
    "tmac",
    "channel_major",
    "channel_major_x86",
    "channel_major_ffn",
)


def compile_in_parallel(compile_serially, object_filenames):
    """A compiler's compile(sources, ...) that compiles each source in its own process, as many at a
    time as there are cores: distutils compiles an extension's sources one after another, and the CPU
    kernels' eleven took 25 s on one core of an install that is bound by compiling."""

    def compile(sources, output_dir=None, **kwargs):
        for obj in object_filenames(sources, output_dir=output_dir):  # (made here: not by two threads at once)
            os.makedirs(os.path.dirname(obj) or ".", exist_ok=True)
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            done = pool.map(lambda source: compile_serially([source], output_dir=output_dir, **kwargs), sources)
            return [obj for objects in done for obj in objects]

    return compile


def cmake_program() -> str:
    """The cmake beside the building Python when one is installed there (PyPI's cmake in a venv that
    builds without isolation, whose bin/ need not be on PATH), else the one on PATH (an isolated
    build puts its own there; `make chat` uses the system's when it is recent enough)."""
    beside = os.path.join(os.path.dirname(sys.executable), "cmake")
    return beside if os.path.isfile(beside) else "cmake"


class CMakeExtension(Extension):
    """An extension built by CMake from the CMakeLists.txt in `source_dir`."""

    def __init__(self, name: str, source_dir: str):
        super().__init__(name, sources=[])
        self.source_dir = os.path.abspath(source_dir)


class BuildExt(build_ext):
    def finalize_options(self):
        # The two extensions build side by side (the CPU kernels' sources compile one after another,
        # CMake's build takes -j): about a fifth off an install on two cores.
        if self.parallel is None:
            self.parallel = True
        super().finalize_options()

    def build_extension(self, ext):
        if not isinstance(ext, CMakeExtension):
            self.compiler.compile = compile_in_parallel(self.compiler.compile, self.compiler.object_filenames)
            return super().build_extension(ext)
        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(os.path.join(self.build_temp, ext.name))
        os.makedirs(build_dir, exist_ok=True)
        try:
            subprocess.run(
                [
                    cmake_program(),
                    "-S",
                    ext.source_dir,
                    "-B",
                    build_dir,
                    f"-DPython_EXECUTABLE={sys.executable}",
                    f"-DMLX_FLASH_OUTPUT_DIR={out_dir}",
                    "-DCMAKE_BUILD_TYPE=Release",
                ],
                check=True,
            )
            subprocess.run([cmake_program(), "--build", build_dir, f"-j{os.cpu_count() or 1}"], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(
                f"warning: {ext.name} was not built ({e}); the MLX backend on a CPU will say so at load",
                file=sys.stderr,
            )

    def get_outputs(self):  # a CMake extension that failed to build is not an output to copy
        return [p for p in super().get_outputs() if os.path.exists(p) or "_mlx_kernels" not in p]


# MLX_FLASH_EXTENSIONS=0 installs the package without compiling: `make chat` installs it editable
# so, then compiles its extensions in place (setup.py build_ext --inplace), the compiler's output in a
# log it shows when the build fails.
EXTENSIONS = os.environ.get("MLX_FLASH_EXTENSIONS", "1") != "0"

setup(
    # kernels/ is mlx_flash.kernels; its source folders are listed too (setuptools treats a folder of a
    # package as a package, and warns at every install about one it is not told of), their files
    # shipped as pyproject's package-data says.
    packages=find_packages(include=["mlx_flash", "mlx_flash.*"])
    + ["mlx_flash.kernels"]
    + [f"mlx_flash.kernels.{folder}" for folder in ("cpu", "cuda", "metal", "mlx", "torch")],
    package_dir={"mlx_flash.kernels": "kernels"},
    ext_modules=[
        Extension(
            "mlx_flash.kernels._qmatmul",
            language="c++",
            extra_compile_args=CXX_FLAGS,
            sources=[f"kernels/cpu/{f}.cpp" for f in CPU_SOURCES],
            depends=[
                "kernels/cpu/qmatmul.h",
                "kernels/cpu/q8.h",
                "kernels/cpu/q8_x86_512.inc",
                "kernels/cpu/q8_x86_512_affine.inc",
                "kernels/cpu/q8_x86_512_tile.inc",
                "kernels/cpu/q8_x86_256.inc",
                "kernels/cpu/gguf_blocks.h",
                "kernels/cpu/matrix_ref.h",
                "kernels/cpu/kv_codes.h",
                "kernels/cpu/attention_kv.h",
                "kernels/cpu/tmac_x86.inc",
                "kernels/cpu/channel_major.h",
            ],
        ),
        CMakeExtension("mlx_flash.kernels._mlx_kernels", "kernels/mlx"),
    ]
    if EXTENSIONS
    else [],
    cmdclass={"build_ext": BuildExt},
)
