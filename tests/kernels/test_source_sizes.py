"""The kernel sources stay small enough to read: every C++, CUDA and Metal file under kernels/ is under
600 lines, as tests/test_layering.py keeps the package's modules under 400. A file that grows past it
is split along a seam of its own (a primitive family, the gathering of operands apart from the
arithmetic, one instruction set's path). torch_build/ holds copies the torch operators' build makes
at run time, not sources, and is not read."""

import os

KERNELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")
SUFFIXES = (".cpp", ".h", ".cu", ".cuh", ".metal", ".mm", ".inc")
LIMIT = 600
NOT_SOURCES = {"torch_build", "__pycache__"}


def sources() -> list[str]:
    found = []
    for root, dirs, files in os.walk(KERNELS_DIR):
        dirs[:] = [d for d in dirs if d not in NOT_SOURCES and not d.startswith(".")]
        found += [os.path.join(root, name) for name in files if name.endswith(SUFFIXES)]
    return sorted(found)


def test_the_walk_sees_the_sources():
    names = {os.path.relpath(p, KERNELS_DIR) for p in sources()}
    for expected in ("cpu/attention.cpp", "mlx/primitives.cpp", "cuda/qmatmul.cu", "metal/sparse_down.metal"):
        assert expected in names


def test_no_kernel_source_is_600_lines_or_more():
    long = []
    for path in sources():
        with open(path, encoding="utf-8") as fh:
            n = sum(1 for _ in fh)
        if n >= LIMIT:
            long.append(f"kernels/{os.path.relpath(path, KERNELS_DIR)}: {n} lines")
    assert not long, f"kernel sources of {LIMIT} lines or more (split them):\n" + "\n".join(long)
