"""What a benchmark's JSON record says about where it ran: the tree (commit, whether it had edits), the
CPU (model, the instruction sets the kernels and the peer dispatch on, cores, the kernels' path), the
versions of everything measured, the command and the time. A figure in the docs names its record, so
a number can always be traced to the code and machine that produced it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata

from ..kernels.qmatmul import cpu_isa

# the /proc/cpuinfo flags that choose a kernel path here or in llama.cpp
DISPATCH_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_int8",
)
PACKAGES = ("mlx-flash-engine", "numpy", "mlx", "torch", "llama_cpp_python", "transformers")


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The flags the first CPU lists (empty where there is no /proc/cpuinfo: not Linux)."""
    try:
        with open(path) as fh:
            return set(next((line.split(":", 1)[1] for line in fh if line.startswith("flags")), "").split())
    except OSError:
        return set()


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    try:
        with open(path) as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _git(*args: str) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance(argv: list[str] | None = None) -> dict:
    """The record's header. `commit` is empty outside a git checkout (an installed wheel); `dirty` says
    whether tracked files differed from it when the run began."""
    flags = cpu_flags()
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "cpu": cpu_model(),
        "cpu_flags": [f for f in DISPATCH_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "kernel_path": cpu_isa().name,
        "versions": versions(),
        "command": " ".join(["python", *(sys.argv if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write(path: str, header: dict, **parts) -> None:
    """One JSON file: the header's fields, then each part under its name."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump({**header, **parts}, fh, indent=1)
