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

from ..config import default_cache_dir
from ..durable import disk_error, write_durably
from ..store.atomic_dir import OutputError
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


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user types it: `python -m mlx_flash.bench NAME ...` for a benchmark run through
    the command family (whose sys.argv[0] is the path of bench/__main__.py, a path of this machine)."""
    args = list(sys.argv if argv is None else argv)
    if args and os.path.basename(args[0]) == "__main__.py" and os.path.basename(os.path.dirname(args[0])) == "bench":
        args[0] = "-m mlx_flash.bench"
    return " ".join(["python", *args])


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where the system has none): a record says how busy
    the machine was before and after, since a neighbour's work slows every figure."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def provenance(argv: list[str] | None = None) -> dict:
    """The record's header. `commit` is empty outside a git checkout (an installed wheel); `dirty` says
    whether tracked files other than the results pages and their records (which a results run
    rewrites as it goes) differed from it when the run began."""
    flags = cpu_flags()
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/results")),
        "cpu": cpu_model(),
        "cpu_flags": [f for f in DISPATCH_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "kernel_path": cpu_isa().name,
        "versions": versions(),
        "command": command_line(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_before": load_average(),
    }


def bench_provenance(name: str, argv: list[str] | None) -> dict:
    """provenance() of the benchmark command NAME run with `argv` (what `python -m mlx_flash.bench`
    hands its main; None: this process's own arguments after NAME)."""
    return provenance(["-m", "mlx_flash.bench", name, *(sys.argv[2:] if argv is None else argv)])


def write(path: str, header: dict, **parts) -> None:
    """One JSON file: the header's fields, the load average now (a run writes its record as it grows,
    so the last write's is the load after), then each part under its name. Written to a temporary
    sibling and renamed into place (durable.write_durably), so a run killed mid-write, or a power
    loss, leaves the previous record whole."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as e:
        raise disk_error(OutputError, path, e) from None
    text = without_local_paths(json.dumps({**header, "load_after": load_average(), **parts}, indent=1))
    write_durably(path, [(text + "\n").encode()], OutputError)


def without_local_paths(text: str) -> str:
    """The record's text with this machine's cache folder written `<cache>` and its home `~`: records
    are committed beside the pages, and a path of the machine that ran them says nothing to a reader
    (the cache's layout is the engine's own: <cache>/synthetic/..., <cache>/stores/...)."""
    cache = json.dumps(default_cache_dir())[1:-1]
    home = json.dumps(os.path.expanduser("~"))[1:-1]
    text = text.replace(cache, "<cache>")
    return text.replace(home + "/", "~/") if len(home) > 1 else text
