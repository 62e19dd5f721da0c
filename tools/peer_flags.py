"""CMAKE_ARGS for building llama.cpp (llama-cpp-python, `make peers`) for the CPU this runs on:
GGML_NATIVE off, so every instruction set is named rather than guessed by the compiler; AVX, AVX2,
FMA and F16C when /proc/cpuinfo lists them; AVX-512 and its VNNI only when the CPU has avx512f /
avx512_vnni (a build that assumes them dies with SIGILL elsewhere); AMX off.

    CMAKE_ARGS="$(python tools/peer_flags.py)" pip install llama-cpp-python
"""

import sys

from mlx_flash.bench.record import cpu_flags  # empty where not Linux: a portable build

# ggml CMake option -> the /proc/cpuinfo flag it needs
OPTIONS = {
    "GGML_AVX": "avx",
    "GGML_AVX2": "avx2",
    "GGML_FMA": "fma",
    "GGML_F16C": "f16c",
    "GGML_AVX512": "avx512f",
    "GGML_AVX512_VNNI": "avx512_vnni",
}
ALWAYS_OFF = ["GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]


def cmake_args(flags: set[str]) -> str:
    on = [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in OPTIONS.items()]
    return " ".join([f"-D{opt}=OFF" for opt in ALWAYS_OFF] + on)


def main() -> int:
    print(cmake_args(cpu_flags()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
