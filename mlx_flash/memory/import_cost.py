"""What importing a backend's framework (and starting the backend) adds to this process's peak RSS,
measured on this machine.

Why measured and not a constant: the cost differs between machines running the same wheel (torch
2.13 CPU: 208 MB on one, about 60 MB more on another), and a guess low by tens of MB lets a limit
pass the check before the import that the import itself then breaks. The first time a limit is close
enough for it to matter, a child process imports the framework and reports its peak RSS over its RSS
before the import; the number is kept in <cache>/import_cost.json, keyed by interpreter, framework
version and machine, so that it is paid once (about 2 s for torch, well under 1 s for MLX).

A child killed while importing (a memory cgroup's OOM killer: the child runs inside the caller's
cgroup) means the import does not fit: the caller refuses the limit instead of importing.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys

from ..durable import write_json
from ..store.atomic_dir import OutputError

FILE = "import_cost.json"
# The child: its RSS before the import (numpy and this package's API in, as in the caller) and its peak
# after importing a module, or after starting a backend ("backend:NAME": the framework's import and
# what the backend sets up when it starts, all of which the caller goes through before it plans).
_CHILD = (
    "import importlib, re, sys\n"
    "import numpy\n"
    "import mlx_flash.api\n"
    "def field(k):\n"
    "    return int(re.search(k + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024\n"
    "before = field('VmRSS')\n"
    "what = sys.argv[1]\n"
    "if what.startswith('backend:'):\n"
    "    from mlx_flash.backends import get_backend\n"
    "    get_backend(what[len('backend:'):])\n"
    "else:\n"
    "    importlib.import_module(what)\n"
    "print(field('VmHWM') - before)\n"
)


class ImportKilled(Exception):
    """The trial import was killed by a signal (out of memory inside a cgroup, most likely)."""


def _key(what: str, module: str) -> str:
    try:
        version = importlib.metadata.version(module.split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return f"{what} {version} {sys.executable} {platform.machine()} {os.cpu_count()}"


def _read(path: str) -> dict:
    try:
        with open(path) as fh:
            kept = json.load(fh)
        return kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        return {}  # a cache that cannot be read is measured again


def measured_import_cost(module: str, estimate: int, cache_dir: str, backend: str | None = None) -> int:
    """Peak RSS bytes that importing `module` adds (with `backend`: starting that backend, whose
    framework `module` is), measured once per machine (see the module docstring); `estimate` where
    it cannot be measured (no /proc, the child failed: the caller's own import then says why).
    Raises ImportKilled when the child was killed."""
    if not os.path.isfile("/proc/self/status"):
        return estimate
    what = f"backend:{backend}" if backend else module
    path = os.path.join(cache_dir, FILE)
    key = _key(what, module)
    kept = _read(path)
    if isinstance(kept.get(key), int):
        return kept[key]
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD, what], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return estimate
    if r.returncode < 0 or r.returncode == 128 + signal.SIGKILL:
        raise ImportKilled(f"a trial import of {module} in a child process was killed (status {r.returncode})")
    try:
        cost = int(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return estimate
    kept[key] = cost
    try:
        os.makedirs(cache_dir, exist_ok=True)
        write_json(path, kept, OutputError)
    except (OSError, OutputError):
        pass  # a read-only cache: measured again next time
    return cost
