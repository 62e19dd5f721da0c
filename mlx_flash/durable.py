"""Files written so that a crash or a power loss leaves either the old file or the whole new one.

Every persistent write of the package goes through here (docs/durability.md lists the sites):

- `DurableFile(path, error)`: the bytes go to a temporary sibling through `os.write`, which is
  fsynced, renamed over the target, and then the folder is fsynced so the rename itself survives.
  A reader never finds a half-written file under the final name.
- `write_durably(path, parts, error)`: the same for bytes already in hand.
- `sync_tree(root)` / `sync_folder(folder)`: for a folder written whole and renamed into place (a
  store): every file and folder below it fsynced before the rename, the parent after it.

A failure raises the caller's `error` (a `DiskError`) in one line that names the file and the cause
as a user would say it: a full disk with the bytes needed and free, a read-only disk, a file where a
folder should be. The writes are plain `os` calls so that a test can fail the Nth of them.
"""

from __future__ import annotations

import errno
import os

from .errors import DiskError
from .units import fmt


def free_bytes(path: str) -> int | None:
    """Bytes a non-root writer may still use on the file system holding `path` (or its nearest
    existing parent); None when it cannot be asked."""
    probe = os.path.abspath(path)
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def file_in_the_way(path: str) -> str | None:
    """The nearest parent of `path` that exists and is not a folder (so nothing can be made below
    it); None when there is none."""
    probe = os.path.dirname(os.path.abspath(path))
    while probe:
        if os.path.exists(probe):
            return None if os.path.isdir(probe) else probe
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    return None


def write_failure(path: str, e: OSError, needed: int | None = None) -> str:
    """One line for a failed write of `path`: what is wrong, as a user would say it."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path)
        parts = [f"needs {fmt(needed)}" if needed else None, f"{fmt(free)} free" if free is not None else None]
        said = ", ".join(p for p in parts if p)
        return f"{path}: the disk is full" + (f" ({said})" if said else "")
    if e.errno == errno.EROFS:
        return f"{path}: the disk is read-only"
    if e.errno in (errno.EEXIST, errno.ENOTDIR):
        blocker = file_in_the_way(path) or (path if os.path.exists(path) and not os.path.isdir(path) else None)
        if blocker:
            return f"{path}: {blocker} is a file, not a folder"
    if e.errno == errno.EACCES:
        return f"{path}: no permission to write it"
    if e.errno == errno.EIO:
        return f"{path}: an I/O error (the disk failed the write)"
    return f"{path}: cannot write it ({e.strerror or e})"


def sync_folder(folder: str) -> None:
    """fsync a folder, so the names made, renamed or removed in it survive a power loss."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str) -> None:
    """fsync every file below `root`, then every folder, deepest first (OSError as raised)."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sync_folder(folder)


class DurableFile:
    """`with DurableFile(path, StoreError) as f: f.write(b)`: on a clean exit the bytes are fsynced
    and renamed over `path` (its folder fsynced); on an error the temporary is removed and `path` is
    left as it was. `needed` (bytes, when known) is named if the disk fills."""

    def __init__(self, path: str, error: type[DiskError], mode: int = 0o644, needed: int | None = None):
        self.path, self.error, self.mode, self.needed = path, error, mode, needed
        self.tmp = f"{path}.tmp-{os.getpid()}"
        self.fd = -1
        self.written = 0

    def __enter__(self) -> DurableFile:
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self.mode)
        except OSError as e:
            raise self.error(write_failure(self.path, e, self.needed)) from None
        return self

    def write(self, data) -> int:
        """Write every byte of `data` (bytes-like); returns how many."""
        view = memoryview(data).cast("B")
        total = view.nbytes
        try:
            while view.nbytes:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as e:
            self._abandon()
            raise self.error(write_failure(self.path, e, self.needed)) from None
        self.written += total
        return total

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self._abandon()
            return
        try:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.path)
            sync_folder(os.path.dirname(os.path.abspath(self.path)))
        except OSError as e:
            self._abandon()
            raise self.error(write_failure(self.path, e, self.needed)) from None

    def _abandon(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def write_durably(path: str, parts, error: type[DiskError], mode: int = 0o644) -> None:
    """Write `parts` (bytes-like) to `path` durably; a failure raises `error` in one line."""
    with DurableFile(path, error, mode=mode) as f:
        for p in parts:
            f.write(p)
