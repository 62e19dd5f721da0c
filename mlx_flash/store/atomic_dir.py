"""Write a directory all at once, one writer at a time.

`atomic_dir(out)` writes into a hidden sibling `.OUT.partial-PID` that replaces `out` only when the
writing finished, so a crash or Ctrl-C never leaves a half-written directory under the real name.
Around it:

- an exclusive lock (`.OUT.lock`, flock) held from before the caller looks at `out` until it is in
  place: a second writer into the same path waits for the first (saying so once), then sees its
  result, so two conversions never clobber each other;
- partial directories of writers that died (SIGKILL, power loss: their PID is gone) are removed
  when the next writer starts in the same folder; SIGTERM is turned into an exit that removes this
  writer's own partial directory first;
- a write that fails (full disk, no permission) is one line naming the path (durable.write_failure);
- the finished folder is made durable before and after its rename (durable.replace_folder).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import sys
import threading
from contextlib import contextmanager, nullcontext

from ..durable import disk_error, move_durably, replace_folder
from ..errors import DiskError

PARTIAL_NAME = re.compile(r"^\.(.+)\.partial-(\d+)(\.old)?$")


class OutputError(DiskError):
    """An output folder or file could not be written (full disk, read-only disk, permissions): the
    error of the package's durable writes (durable.py) of stores and the files beside them."""


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_dead_partials(parent: str) -> list[str]:
    """Remove the partial directories in `parent` whose writer's process is gone; their names. A
    writer that died between its two renames (the old output moved aside, the new one not yet in
    place: durable.replace_folder) left no output: the new folder, whole since it was fsynced before
    the old moved, is put in place (or, if it is gone, the old one back) before the rest goes."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    dead = [
        (name, m)
        for name in names
        if (m := PARTIAL_NAME.match(name)) and int(m.group(2)) != os.getpid() and not process_alive(int(m.group(2)))
    ]
    for name, m in dead:
        out = os.path.join(parent, m.group(1))
        if m.group(3) and not os.path.lexists(out):
            new = os.path.join(parent, name[: -len(".old")])
            move_durably(new if os.path.isdir(new) else os.path.join(parent, name), out, OutputError)
    for name, _m in dead:
        if os.path.lexists(os.path.join(parent, name)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(name)
    return removed


@contextmanager
def output_lock(out_dir: str, progress: bool = True):
    """Hold the exclusive lock of `out_dir` (waiting for another holder, said once on stderr)."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)  # the lock lives beside the output: its folder comes first
    except OSError as e:
        raise disk_error(OutputError, parent, e) from None
    path = os.path.join(parent, f".{os.path.basename(out_dir)}.lock")
    while True:
        try:  # (not durable: a lock holds no data, only the holder's pid for the waiting message)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise disk_error(OutputError, path, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            if progress:
                print(f"waiting for another writer of {out_dir} (pid {holder}) to finish", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # the holder before us may have removed the lock file: then lock the new one
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        try:  # (the pid is for a waiter's message; a disk too full for it is said like any write)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError as e:
            raise disk_error(OutputError, path, e) from None
        yield
    finally:
        try:
            os.unlink(path)  # while held: a waiter that opened it sees it gone and retries
        except OSError:
            pass
        os.close(fd)


@contextmanager
def _terminate_as_exit():
    """SIGTERM raises SystemExit (so `finally` blocks clean up) while inside; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def atomic_dir(out_dir: str, progress: bool = True, locked: bool = False):
    """with atomic_dir(out) as tmp: write into tmp; on success tmp becomes out (replacing it). The
    lock is held throughout (`locked`: the caller holds output_lock already, having looked at
    `out` under it)."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise disk_error(OutputError, parent, e) from None
    with nullcontext() if locked else output_lock(out_dir, progress), _terminate_as_exit():
        remove_dead_partials(parent)
        tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp)
            yield tmp
            # every file of tmp fsynced, then the rename, then the parent: a power loss leaves the
            # old folder or the whole new one under out_dir, never one with holes
            replace_folder(tmp, out_dir, OutputError)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_error(OutputError, e.filename or out_dir, e) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
