"""How much memory this process may use, and how much it holds: read from the kernel (Linux cgroup
v2 / v1 files, /proc) or, elsewhere, from the platform's totals. No framework imports."""

from __future__ import annotations

import os
from dataclasses import dataclass

_CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 1 << 60  # cgroup v1 writes ~2^63 for "no limit"


@dataclass(frozen=True)
class Available:
    bytes: int  # memory this process may use in all, what it holds now included
    source: str  # where the number came from, for the plan line and errors


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = _CGROUP_ROOT) -> tuple[int, str] | None:
    """The tightest memory limit on this process's cgroup and its ancestors (v2 memory.max, v1
    memory.limit_in_bytes), or None when no limit applies."""
    text = _read(proc_cgroup)
    if not text:
        return None
    best = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2 unified hierarchy
            base, file, label = (
                root if os.path.exists(os.path.join(root, "cgroup.controllers")) else os.path.join(root, "unified"),
                "memory.max",
                "cgroup v2 memory.max",
            )
        elif "memory" in controllers.split(","):
            base, file, label = os.path.join(root, "memory"), "memory.limit_in_bytes", "cgroup v1 memory limit"
        else:
            continue
        rel = path.strip("/")
        while True:  # this cgroup, then each ancestor up to the root
            value = _read(os.path.join(base, rel, file))
            if value and value != "max" and value.isdigit() and int(value) < _NO_LIMIT:
                if best is None or int(value) < best[0]:
                    best = (int(value), label)
            if not rel:
                break
            rel = os.path.dirname(rel)
    return best


def _kib_field(path: str, key: str) -> int | None:
    """Bytes of a "Key:  123 kB" line of a /proc file (meminfo, status), or None."""
    text = _read(path)
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def process_rss() -> int:
    """Resident bytes of this process now (VmRSS; the platform's resident size elsewhere)."""
    return _kib_field("/proc/self/status", "VmRSS") or _ru_maxrss()


def peak_rss() -> int:
    """The most resident bytes this process has held (VmHWM)."""
    return _kib_field("/proc/self/status", "VmHWM") or _ru_maxrss()


def _ru_maxrss() -> int:
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def available_memory() -> Available:
    """The cgroup limit when one applies (capped by the machine's memory), else the memory the
    machine has available now plus what this process already holds."""
    total = _kib_field("/proc/meminfo", "MemTotal")
    cg = _cgroup_limit()
    if cg is not None:
        limit, label = cg
        return Available(min(limit, total) if total else limit, label)
    avail = _kib_field("/proc/meminfo", "MemAvailable")
    if avail is not None:
        return Available(avail + process_rss(), "available memory")
    try:  # macOS and other platforms without /proc: the machine's physical memory
        return Available(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory")
    except (ValueError, OSError):
        import subprocess

        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True).stdout.strip()
        return Available(int(out), "physical memory")
