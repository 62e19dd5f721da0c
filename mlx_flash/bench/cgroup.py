"""Run a command inside a memory limit and read what it cost, for benchmarks at limits below the
model's size (the memory, pipeline and long-context benchmarks, throughput --cgroup, and budget_kept.py
here): a fresh child of this process's own memory cgroup with the limit (cgroup v1
memory.limit_in_bytes, swap included where memsw exists; v2 memory.max, no swap), the peak the
kernel charged to it (RSS and page cache), the pages it read again after the limit evicted them,
and its OOM kills; the page cache dropped before a cold run; the read bandwidth of the drive
holding a file.

Linux and root only; anything else is refused with one line saying what is missing."""

from __future__ import annotations

import itertools
import mmap
import os
import resource
import subprocess
import time
from dataclasses import dataclass

import numpy as np

from ..errors import FlashError
from ..store.reader_pool import ReaderPool

CGROUP_ROOT = "/sys/fs/cgroup"
# The measured child of the memory, long-context and pipeline benchmarks, run by its path (never as
# `-m`, which would import this package into the process whose memory is measured).
MEMORY_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_child.py")
_serial = itertools.count()


@dataclass(frozen=True)
class CgroupRun:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    limit: int
    peak: int  # most bytes the cgroup was charged at once: anonymous memory and page cache
    refault_bytes: int  # pages read back after the limit had evicted them (memory.stat workingset_refault_*)
    oom_kills: int
    major_faults: int  # of the child, from the rusage its parent collects (an OOM-killed child has one too)
    read_bytes: int  # block input of the child (ru_inblock x 512): what it read from the drive
    wall_s: float
    cpu_s: float  # the child's user + system time
    machine_busy_s: float  # every CPU's busy time meanwhile: what exceeds cpu_s ran beside the child

    @property
    def others_share(self) -> float:
        """Share of the machine's CPU time that other processes used during the run (a measurement
        taken while something else ran says so)."""
        return max(0.0, self.machine_busy_s - self.cpu_s) / max(1e-9, self.wall_s * (os.cpu_count() or 1))

    @property
    def oom_killed(self) -> bool:
        return self.oom_kills > 0

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def own_memory_cgroup(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> tuple[str, int]:
    """(the directory of this process's memory cgroup, cgroup version 1 or 2), or a FlashError
    saying why limits cannot be set here (not root, not Linux, no memory controller)."""
    if not hasattr(os, "geteuid") or not os.path.exists(proc_cgroup):
        raise FlashError("memory limits need Linux cgroups; this platform has none")
    if os.geteuid() != 0:
        raise FlashError("memory limits need root (they create cgroups and drop the page cache); run as root")
    with open(proc_cgroup) as fh:
        lines = [line.strip().split(":", 2) for line in fh if line.count(":") >= 2]
    for _, controllers, path in lines:
        if "memory" in controllers.split(",") and os.path.isdir(os.path.join(root, "memory")):
            return os.path.join(root, "memory", path.strip("/")), 1
    for _, controllers, path in lines:
        unified = os.path.join(root, "cgroup.controllers")
        if controllers == "" and os.path.exists(unified) and "memory" in _read(unified).split():
            return os.path.join(root, path.strip("/")), 2
    raise FlashError(f"no cgroup memory controller is mounted under {root} (cgroup v1 memory or v2 with memory)")


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as fh:  # (a kernel control file, not data: nothing to make durable)
            fh.write(value)
    except OSError as e:
        raise FlashError(f"{path}: cannot write {value!r} ({e.strerror})") from None


def _keyed(text: str) -> dict[str, int]:
    """'key value' lines (memory.oom_control, memory.events) as a dict."""
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}


class MemoryCgroup:
    """A new cgroup under this process's own, capped at `limit` bytes; removed by close()."""

    def __init__(self, limit: int, name: str = "mlx_flash_limit"):
        parent, self.version = own_memory_cgroup()
        self.limit = int(limit)
        self.path = os.path.join(parent, f"{name}_{os.getpid()}_{next(_serial)}")
        try:
            os.mkdir(self.path)
        except OSError as e:
            raise FlashError(f"{self.path}: cannot create a cgroup ({e.strerror})") from None
        if self.version == 1:
            _write(self._file("memory.limit_in_bytes"), str(self.limit))
            if os.path.exists(self._file("memory.memsw.limit_in_bytes")):  # swap may not stretch the limit
                _write(self._file("memory.memsw.limit_in_bytes"), str(self.limit))
        else:
            if "memory" not in _read(self._file("cgroup.controllers")).split():
                _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
            _write(self._file("memory.max"), str(self.limit))
            if os.path.exists(self._file("memory.swap.max")):
                _write(self._file("memory.swap.max"), "0")

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def run(self, cmd: list[str], timeout: float | None = None, env: dict | None = None) -> CgroupRun:
        """Run `cmd` in this cgroup (a shell joins it, then execs the command, so nothing of the
        command runs outside the limit) and wait for it; output is captured as text."""
        before, busy0 = resource.getrusage(resource.RUSAGE_CHILDREN), machine_busy_s()
        t0 = time.perf_counter()
        try:
            r = subprocess.run(self.joined(cmd), capture_output=True, text=True, timeout=timeout, env=env)
            code, out, err = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            code, out, err = None, _text(e.stdout), _text(e.stderr)
        wall = time.perf_counter() - t0
        after, busy1 = resource.getrusage(resource.RUSAGE_CHILDREN), machine_busy_s()
        peak, ooms = self.usage()
        stat = _keyed(_read(self._file("memory.stat")))
        refaults = (stat.get("workingset_refault_file", 0) + stat.get("workingset_refault_anon", 0)) * os.sysconf(
            "SC_PAGE_SIZE"
        )
        return CgroupRun(
            code,
            out,
            err,
            self.limit,
            peak,
            refaults,
            ooms,
            after.ru_majflt - before.ru_majflt,
            (after.ru_inblock - before.ru_inblock) * 512,
            wall,
            after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            busy1 - busy0,
        )

    def joined(self, cmd: list[str]) -> list[str]:
        """`cmd` as a command that joins this cgroup first (a shell writes its pid, then execs the
        command, so nothing of it runs outside the limit): for run(), or a Popen of a server."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', self._file("cgroup.procs"), *cmd]

    def usage(self) -> tuple[int, int]:
        """(peak bytes, OOM kills) of the cgroup so far."""
        if self.version == 1:  # (v1 memory.failcnt stays 0 at the limit on recent kernels: refaults say more)
            peak = int(_read(self._file("memory.max_usage_in_bytes")))
            return peak, _keyed(_read(self._file("memory.oom_control"))).get("oom_kill", 0)
        peak = int(_read(self._file("memory.peak"))) if os.path.exists(self._file("memory.peak")) else 0
        return peak, _keyed(_read(self._file("memory.events"))).get("oom_kill", 0)

    def close(self) -> None:
        for _ in range(50):  # the last task leaves the cgroup a moment after it is reaped
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def machine_busy_s() -> float:
    """CPU seconds every core has spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def drop_page_cache() -> None:
    """Write back dirty pages and drop the clean page cache, dentries and inodes: the next run
    reads the model (and the interpreter's libraries) from the drive."""
    os.sync()
    try:
        _write("/proc/sys/vm/drop_caches", "3")
    except FlashError as e:
        raise FlashError(f"cannot drop the page cache for a cold run: {e}") from None


# (threads, chunk bytes) the bandwidth probe tries: drives (and virtual disks) deliver more with
# more bytes in flight, and the bound must be the most the drive gives, not one setting's rate
PROBE_GRID = ((4, 8 << 20), (16, 8 << 20), (4, 32 << 20), (16, 32 << 20))


def read_bandwidth(path: str, grid=PROBE_GRID) -> float:
    """The most bytes/s of the drive holding `path` over the probe grid, page cache bypassed.

    Each setting reads its own slice of `path` (the file cut into as many slices as settings), every
    chunk of the slice exactly once, in random order (sequential within a chunk, the way an engine
    reads a layer). Reading a byte twice would measure a cache: behind a virtual disk the host keeps
    what was just read, and a probe drawing random offsets with repeats saw 7.4 GB/s here where
    reading each byte once gives 2.2."""

    size = os.path.getsize(path)
    part = size // len(grid) // 4096 * 4096
    rng = np.random.default_rng(0)
    best = 0.0
    for k, (threads, chunk) in enumerate(grid):
        chunk = max(4096, min(chunk, part // 8 // 4096 * 4096))
        offsets = k * part + rng.permutation(part // chunk) * chunk
        if offsets.size == 0:
            continue
        drop_page_cache()
        with ReaderPool(threads=threads, mode="direct", coalesce_gap=0, max_chunk=chunk) as pool:
            f = pool.open(path)
            buf = mmap.mmap(-1, chunk * threads)  # one landing slot per worker, reused like fio's buffer
            slots = (np.arange(offsets.size) % threads) * chunk
            t = time.perf_counter()
            pool.submit_rows(f, offsets, chunk, np.frombuffer(buf, dtype=np.uint8), slots).wait()
            best = max(best, offsets.size * chunk / (time.perf_counter() - t))
    return best


def replay_reads(batches: list[list[tuple[str, int, int]]], threads: int, mode: str = "direct") -> float:
    """Seconds the reader pool takes to read `batches` of (path, offset, length) again, one batch
    after another as an engine waited for them, the page cache dropped first: the drive's rate for
    exactly the byte ranges a run read (its decode can go no faster than this while it reads them)."""
    files: dict[str, object] = {}
    biggest = max((sum(-(-n // 4096) * 4096 for _, _, n in b) for b in batches), default=0)
    if biggest == 0:
        return 0.0
    drop_page_cache()
    buf = mmap.mmap(-1, biggest)
    dest = np.frombuffer(buf, dtype=np.uint8)
    with ReaderPool(threads=threads, mode=mode) as pool:
        t = time.perf_counter()
        for b in batches:
            ranges, at = [], 0
            for path, off, n in b:
                f = files.get(path) or files.setdefault(path, pool.open(path))
                ranges.append((f, off, n, dest[at : at + n]))
                at += -(-n // 4096) * 4096  # each range lands page-aligned, as in an engine's slots
            pool.read(ranges)
        return time.perf_counter() - t
