"""Fault injection at every write and read the package makes, in the manner of SQLite's I/O-error
tests: a counting pass numbers the injection points of an operation (every `os.write`, `os.pwrite`,
`os.fsync`, `os.replace`, `os.rename`, `os.posix_fallocate`, `os.mkdir`, `os.preadv`, `os.pread`
called from mlx_flash code, and the reader pool's own `_preadv`), then the operation runs once per
point with that point failing as the disk would fail it (ENOSPC for a write, a rename, a new folder
or a reservation, EIO for an fsync or a read; a read may also come back short; a write or a read
may fail from there on, as a full or failing disk does), and each run is held to three rules:

1. it raises a DiskError (the machine's fault: a server answers it 5xx) whose message is one line,
   or it absorbs the fault and returns exactly what the fault-free run returns; any other exception
   is a bug and fails the test with its traceback (FaultEscaped, chained to it);
2. what the package's own reader then finds is absent, refused in one line, what was there before,
   or the fault-free result: never a half-written file read as good;
3. the operation run again without the fault returns the fault-free result.

Only calls whose first caller outside the standard library's file helpers (os, shutil, tempfile)
is an mlx_flash module count: pytest, numpy and the interpreter write too.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

import mlx_flash.store
from mlx_flash.errors import DiskError, FlashError
from mlx_flash.store import reader_pool

# kind -> the os functions of that kind, and the errno their failure raises
KINDS = {
    "write": ("write", "pwrite"),
    "fsync": ("fsync",),
    "rename": ("replace", "rename"),
    "fallocate": ("posix_fallocate",),
    "mkdir": ("mkdir",),
    "read": ("preadv", "pread"),
}
ERRNO = {
    "write": errno.ENOSPC,
    "fsync": errno.EIO,
    "rename": errno.ENOSPC,
    "fallocate": errno.ENOSPC,
    "mkdir": errno.ENOSPC,
    "read": errno.EIO,
}
# how a point of each kind fails: "error" raises its OSError once, "persistent" at that point and every
# later one of any kind (a disk that stays full or failing), "short" (reads) returns half the bytes
MODES = {
    "write": ("error", "persistent"),
    "fsync": ("error",),
    "rename": ("error",),
    "fallocate": ("error",),
    "mkdir": ("error",),
    "read": ("error", "short", "persistent"),
}
# modules whose calls are made on behalf of their caller (os.makedirs, shutil.rmtree, tempfile.mkstemp)
HELPERS = frozenset({"os", "shutil", "tempfile", "posixpath", "genericpath"})
ABSENT = "absent"  # what a read_back returns when the package finds nothing


@dataclass(frozen=True)
class Refused:
    """What a read_back that raised a one-line FlashError is recorded as."""

    error: str


def package_frame(depth: int):
    """The frame of the call `depth` levels up, past the standard library's file helpers, when it is
    mlx_flash code; None otherwise."""
    f = sys._getframe(depth + 1)
    while f is not None and f.f_globals.get("__name__") in HELPERS:
        f = f.f_back
    if f is None or not f.f_globals.get("__name__", "").startswith("mlx_flash"):
        return None
    return f


@dataclass(frozen=True)
class Point:
    index: int
    kind: str
    function: str
    where: str  # module:function:line of the package's call

    def __str__(self) -> str:
        return f"point {self.index} (os.{self.function} at {self.where})"


class Injector:
    """While entered, every package call of the faulted kinds is a numbered point; point `fail_at`
    fails in `mode` (MODES, or "bug": raises `bug`, an exception that is not an OSError)."""

    def __init__(self, fail_at: int | None = None, mode: str = "error", bug: BaseException | None = None):
        self.fail_at, self.mode, self.bug = fail_at, mode, bug
        self.points: list[Point] = []
        self.fired: Point | None = None
        self._lock = threading.Lock()  # the reader pool's workers read side by side
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> Injector:
        for kind, names in KINDS.items():
            for name in names:
                self._patch(os, name, kind)
        self._patch(reader_pool, "_preadv", "read")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()

    def _patch(self, owner, name: str, kind: str) -> None:
        real = getattr(owner, name)
        self._saved.append((owner, name, real))
        function = name.lstrip("_")

        def faulty(*args, **kw):
            f = package_frame(1)
            if f is None or not self._hit(kind, function, f):
                return real(*args, **kw)
            return self._fail(kind, function, real, args, kw)

        setattr(owner, name, faulty)

    def _hit(self, kind: str, function: str, frame) -> bool:
        where = f"{frame.f_globals['__name__']}:{frame.f_code.co_name}:{frame.f_lineno}"
        with self._lock:
            point = Point(len(self.points), kind, function, where)
            self.points.append(point)
            if self.fail_at is None or point.index < self.fail_at:
                return False
            if point.index > self.fail_at and self.mode != "persistent":
                return False
            self.fired = self.fired or point
            return True

    def _fail(self, kind: str, function: str, real, args, kw):
        if self.mode == "bug":
            raise self.bug
        if self.mode == "short" and kind == "read":
            return _short_read(function, real, args, kw)
        code = ERRNO[kind]
        raise OSError(code, os.strerror(code))

    def by_kind(self) -> Counter:
        return Counter(p.kind for p in self.points)


def _short_read(function: str, real, args, kw):
    """A read that returns half of what it was asked (as a read cut by the end of a file, a signal or
    a failing device returns; a direct read's half stays on whole 512-byte sectors where it can)."""
    if function == "pread":
        data = real(*args, **kw)
        return data[: len(data) // 2]
    fd, buffers, offset = args[0], args[1], args[2]
    first = memoryview(buffers[0]).cast("B")
    half = first.nbytes // 2 // 512 * 512 or first.nbytes // 2
    if half == 0:
        return 0
    return real(fd, [first[:half]], offset, *args[3:], **kw)


class FaultEscaped(AssertionError):
    """An injected fault made the package do what it must not: another exception than a one-line
    FlashError (chained: its traceback is shown), a message of several lines, a bad result read as
    good, or a failure on the run after the fault."""


@dataclass
class Operation:
    """What a fault test runs: `setup()` a fresh state; `run(state)` the operation, returning its
    result (compared with ==, numpy arrays by value); `read_back(state)` what the package's reader
    finds afterwards (a value, ABSENT, or a FlashError: a refusal), run without faults;
    `teardown(state)` once a state is done with (a service's reader threads closed)."""

    name: str
    setup: Callable[[], Any]
    run: Callable[[Any], Any]
    read_back: Callable[[Any], Any] = lambda state: None
    teardown: Callable[[Any], None] = lambda state: None


@dataclass
class Report:
    name: str
    points: list[Point]
    runs: int = 0
    outcomes: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    known: dict[str, tuple[str, str]] = field(default_factory=dict)  # point and mode -> (known bug, what broke)

    def by_kind(self) -> Counter:
        return Counter(p.kind for p in self.points)

    def line(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.by_kind().items()))
        said = ", ".join(f"{n} {k}" for k, n in sorted(self.outcomes.items()))
        return (
            f"[faults] {self.name}: {len(self.points)} injection points ({kinds}); "
            f"{self.runs} faulted runs in {self.seconds:.1f} s: {said}"
        )


def same(a, b) -> bool:
    """== for results that hold numpy arrays (in tuples, lists or dicts)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _one_line(e: FlashError, what: str) -> None:
    msg = str(e)
    if not msg.strip() or "\n" in msg:
        raise FaultEscaped(f"{what}: {type(e).__name__} is not one line: {msg!r}") from e


def _read_back(op: Operation, state, what: str):
    """op.read_back without faults: its value, or Refused(the error's class) for a one-line refusal."""
    try:
        return op.read_back(state)
    except FlashError as e:
        _one_line(e, f"{what}: reading back")
        return Refused(type(e).__name__)
    except Exception as e:  # not a FlashError: a bug, shown with its traceback
        raise FaultEscaped(f"{what}: reading back raised {type(e).__name__}: {e}") from e


def count(op: Operation) -> tuple[Report, Any, Any, Any]:
    """The counting pass: (report with the points, the result, what is read back before and after)."""
    # what is there before, read from a state of its own: a faulted run reads nothing before it runs
    state = op.setup()
    try:
        before = _read_back(op, state, f"{op.name}: before")
    finally:
        op.teardown(state)
    state = op.setup()
    try:
        with Injector() as inj:
            result = op.run(state)
        after = _read_back(op, state, f"{op.name}: fault-free")
    finally:
        op.teardown(state)
    return Report(op.name, inj.points), result, before, after


def check(
    op: Operation,
    stride: int = 1,
    modes: dict | None = None,
    bug: BaseException | None = None,
    known: dict[str, str] | None = None,
) -> Report:
    """Run `op` with every `stride`-th point failing (each in every mode of its kind: MODES, or
    `modes`; with `bug`, that exception instead of an OSError); raises FaultEscaped on the first
    rule broken. `known`: text -> a known bug: a run that breaks a rule where the point
    ("module:function" of the package's call) or the broken rule's message holds that text is
    recorded in report.known instead (the caller marks the test xfail with the reason), and the
    other points go on. Returns the report (print its line())."""
    t0 = time.perf_counter()
    report, reference, before, reference_back = count(op)
    if not report.points:
        raise FaultEscaped(f"{op.name}: the operation makes no call that can be faulted")
    for point in report.points[::stride]:
        for mode in ("bug",) if bug is not None else (modes or MODES)[point.kind]:
            state = op.setup()
            try:
                _faulted_run(op, state, point, mode, bug, reference, before, reference_back, report)
            except FaultEscaped as e:
                reason = next((r for text, r in (known or {}).items() if text in f"{point.where} {e}"), None)
                if reason is None:
                    raise
                report.known[f"{point}, {mode}"] = (reason, str(e))
                report.outcomes["a known bug"] += 1
            finally:
                op.teardown(state)
    report.seconds = time.perf_counter() - t0
    return report


def _faulted_run(op, state, point: Point, mode: str, bug, reference, before, reference_back, report: Report) -> None:
    what = f"{op.name}: {point}, {mode}"
    with Injector(point.index, mode, bug) as inj:
        try:
            result, raised = op.run(state), None
        except FlashError as e:
            result, raised = None, e
        except Exception as e:  # any other exception is a bug: shown with its traceback
            raise FaultEscaped(f"{what}: {type(e).__name__} escaped instead of a one-line FlashError: {e}") from e
    report.runs += 1
    if raised is not None:
        _one_line(raised, what)
        if not isinstance(raised, DiskError):  # a server would answer it 4xx: the request's fault, not the disk's
            raise FaultEscaped(f"{what}: refused with {type(raised).__name__}, not a DiskError: {raised}") from raised
        outcome = f"refused ({type(raised).__name__})"
    elif not same(result, reference):
        raise FaultEscaped(f"{what}: the operation returned without an error but its result differs from the reference")
    else:
        outcome = "absorbed" if inj.fired is not None else "not reached"
    found = _read_back(op, state, what)
    if not (same(found, ABSENT) or isinstance(found, Refused) or same(found, reference_back) or same(found, before)):
        raise FaultEscaped(f"{what}: the package's reader finds a result that is neither the old one nor the new one")
    try:
        again = op.run(state)
    except Exception as e:  # a fault must not outlive its run: shown with its traceback
        raise FaultEscaped(f"{what}: run again without the fault, it raised {type(e).__name__}: {e}") from e
    if not same(again, reference):
        raise FaultEscaped(f"{what}: run again without the fault, the operation's result differs from the reference")
    if not same(_read_back(op, state, f"{what}, run again"), reference_back):
        raise FaultEscaped(f"{what}: run again without the fault, what is read back differs from the reference")
    report.outcomes[outcome] += 1


def show(report: Report) -> None:
    """Print the report's line; a known bug that broke a rule marks the test xfail, naming it."""
    print("\n" + report.line())
    broken = [broke for _, broke in report.known.values()]
    for broke in broken[:3]:
        print(f"[faults]   a known bug: {broke}")
    if len(broken) > 3:
        print(f"[faults]   ... and {len(broken) - 3} more runs that reach a known bug")
    if report.known:
        pytest.xfail("; ".join(sorted({reason for reason, _ in report.known.values()})))


def store_files(path: str) -> dict:
    """What a store reader finds: the store opened (its manifest checked, every file hashed against
    it), then every file's bytes."""
    mlx_flash.store.open_store(path)
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out
