"""Files written so that a crash or a power loss leaves either the old file or the whole new one.

Every persistent write of the package goes through here (docs/durability.md lists the sites):

- `DurableFile(path, error)`: the bytes go to a temporary sibling through `os.write`, which is
  fsynced, renamed over the target, and then the folder is fsynced so the rename itself survives.
  A reader never finds a half-written file under the final name.
- `write_durably(path, parts, error)`, `write_json(...)`: the same for bytes (an object) in hand.
- `FolderFile`, `write_new`, `copy_new`: a new file inside a folder written whole (a store), in
  place and fsynced on close; `replace_folder(tmp, out, error)` then puts the folder in place:
  `sync_tree` (every file and folder below it fsynced), the rename, `sync_folder` of the parent.
- `AppendFile`, `move_durably`, `truncate_durably`: a file grown across runs (a resumable
  download, a batch's output), renamed into place when whole, or cut back to its last whole record.

A failure raises the caller's `error` (a `DiskError`) in one line that names the file and the cause
as a user would say it: a full disk with the bytes needed and free, a read-only disk, a file where a
folder should be (`disk_error`; its `full` says a disk with no room, which a server answers 507). The
writes are plain `os` calls so that a test can fail the Nth of them.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

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
    if e.errno in FULL:
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
    if e.errno == errno.ENOENT and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        return f"{path}: its folder {os.path.dirname(os.path.abspath(path))} does not exist"
    if e.errno == errno.EACCES:
        return f"{path}: no permission to write it"
    if e.errno == errno.EIO:
        return f"{path}: an I/O error (the disk failed the write)"
    return f"{path}: cannot write it ({e.strerror or e})"


FULL = (errno.ENOSPC, errno.EDQUOT)  # the errors of a disk (or a quota) with no room left


def disk_error(error: type[DiskError], path: str, e: OSError, needed: int | None = None, said: str = "") -> DiskError:
    """`error` for a failed write of `path`: write_failure's line (after `said: `, when given), and
    whether it is a full disk, which a server answers 507."""
    line = write_failure(path, e, needed)
    return error(f"{said}: {line}" if said else line, full=e.errno in FULL)


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


class _Writer:
    """An open file written front to back with `os.write` (every byte of each call, in one call per
    chunk however large: no per-element writes); the subclasses say where the bytes land."""

    def __init__(self, path: str, error: type[DiskError], mode: int = 0o644, needed: int | None = None):
        self.path, self.error, self.mode, self.needed = path, error, mode, needed
        self.fd = -1
        self.written = 0

    def _open(self, target: str, how: int = os.O_TRUNC) -> None:
        try:
            self.fd = os.open(target, os.O_WRONLY | os.O_CREAT | how | os.O_CLOEXEC, self.mode)
        except OSError as e:
            raise disk_error(self.error, self.path, e, self.needed) from None

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
            raise disk_error(self.error, self.path, e, self.needed) from None
        self.written += total
        return total

    def tell(self) -> int:
        """Bytes written so far (the offset the next write lands at)."""
        return self.written

    def write_at(self, data, offset: int) -> None:
        """Write every byte of `data` at `offset` (os.pwrite; the sequential position is left)."""
        view = memoryview(data).cast("B")
        try:
            while view.nbytes:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as e:
            self._abandon()
            raise disk_error(self.error, self.path, e, self.needed) from None

    def reserve(self, size: int) -> None:
        """Give the file `size` bytes of disk now (zeros), so a disk too small for it fails here, in
        one line naming the bytes needed and free, not after minutes of writing."""
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            self._abandon()
            raise disk_error(self.error, self.path, e, size) from None

    def pad_to(self, alignment: int) -> None:
        """Zeros up to the next multiple of `alignment` bytes."""
        pad = -self.written % alignment
        if pad:
            self.write(bytes(pad))

    def _sync_and_close(self) -> None:
        os.fsync(self.fd)
        fd, self.fd = self.fd, -1
        os.close(fd)

    def _abandon(self) -> None:
        raise NotImplementedError

    def _commit(self) -> None:
        raise NotImplementedError

    def __exit__(self, kind, value, tb) -> None:
        """A clean exit commits the bytes (the subclass says how); an error removes what was written."""
        if kind is not None:
            self._abandon()
            return
        try:
            self._commit()
        except OSError as e:
            self._abandon()
            raise disk_error(self.error, self.path, e, self.needed) from None


class FolderFile(_Writer):
    """`with FolderFile(path, OutputError) as f: f.write(b)`: a new file inside a folder that is
    written whole and then renamed into place (store/atomic_dir.py), so it needs no temporary of its
    own: its bytes are fsynced on close, and `sync_tree` + the folder's rename make its name durable.
    On an error the file is removed."""

    def __enter__(self) -> FolderFile:
        self._open(self.path)
        return self

    def _commit(self) -> None:
        self._sync_and_close()

    def _abandon(self) -> None:
        _close_and_remove(self.fd, self.path)
        self.fd = -1


class DurableFile(_Writer):
    """`with DurableFile(path, StoreError) as f: f.write(b)`: on a clean exit the bytes are fsynced
    and renamed over `path` (its folder fsynced); on an error the temporary is removed and `path` is
    left as it was. `needed` (bytes, when known) is named if the disk fills."""

    def __init__(self, path: str, error: type[DiskError], mode: int = 0o644, needed: int | None = None):
        super().__init__(path, error, mode, needed)
        self.tmp = f"{path}.tmp-{os.getpid()}"

    def __enter__(self) -> DurableFile:
        self._open(self.tmp)
        return self

    def _commit(self) -> None:
        self._sync_and_close()
        os.replace(self.tmp, self.path)
        sync_folder(os.path.dirname(os.path.abspath(self.path)))

    def _abandon(self) -> None:
        _close_and_remove(self.fd, self.tmp)
        self.fd = -1


class AppendFile(_Writer):
    """`with AppendFile(path, error, fresh) as f: f.write(b)`: bytes appended to `path` (emptied
    first when `fresh`), fsynced when the block ends, however it ends: what arrived survives a crash
    that follows, and a later run goes on from the file's end (a resumable download). The file is
    kept on an error; the caller renames it into place when whole (move_durably)."""

    def __init__(self, path: str, error: type[DiskError], fresh: bool, mode: int = 0o644, needed: int | None = None):
        super().__init__(path, error, mode, needed)
        self.fresh = fresh

    def __enter__(self) -> AppendFile:
        self._open(self.path, os.O_TRUNC if self.fresh else os.O_APPEND)
        return self

    def sync(self) -> None:
        """fsync what was appended so far (a result reported as done survives a crash)."""
        try:
            os.fsync(self.fd)
        except OSError as e:
            self._abandon()
            raise disk_error(self.error, self.path, e) from None

    def __exit__(self, kind, value, tb) -> None:
        if self.fd < 0:  # (a failed write closed it)
            return
        try:
            self._sync_and_close()
        except OSError as e:
            self._abandon()
            if kind is None:  # (else the error in flight says more)
                raise disk_error(self.error, self.path, e) from None

    def _abandon(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd = -1


def truncate_durably(path: str, size: int, error: type[DiskError]) -> None:
    """Cut the file `path` to `size` bytes (a torn last record dropped), fsynced."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise disk_error(error, path, e) from None


def _close_and_remove(fd: int, path: str) -> None:
    """Clean up after a failed write; errors here would only hide the one being raised."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.unlink(path)
    except OSError:
        pass


def write_durably(path: str, parts, error: type[DiskError], mode: int = 0o644) -> None:
    """Write `parts` (bytes-like) to `path` durably; a failure raises `error` in one line."""
    with DurableFile(path, error, mode=mode) as f:
        for p in parts:
            f.write(p)


def write_new(path: str, parts, error: type[DiskError], mode: int = 0o644) -> None:
    """Write `parts` (bytes-like) to a new file inside a folder written whole (see FolderFile)."""
    with FolderFile(path, error, mode=mode) as f:
        for p in parts:
            f.write(p)


def write_json(path: str, obj, error: type[DiskError], indent: int | None = 1, in_folder: bool = False) -> None:
    """`obj` as JSON (UTF-8, non-ASCII kept) to `path`: durably, or (`in_folder`) as a FolderFile."""
    data = json.dumps(obj, indent=indent, ensure_ascii=False).encode()
    (write_new if in_folder else write_durably)(path, [data], error)


COPY_CHUNK = 16 << 20  # bytes per read and write of a copy: few calls, little memory


def copy_new(src: str, dst: str, error: type[DiskError]) -> None:
    """Copy the file `src` to a new file `dst` inside a folder written whole (see FolderFile); a
    source that cannot be read is the caller's OSError to name."""
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with FolderFile(dst, error, needed=os.fstat(fd).st_size) as out:
            while chunk := os.read(fd, COPY_CHUNK):
                out.write(chunk)
    finally:
        os.close(fd)


def replace_folder(tmp: str, out: str, error: type[DiskError]) -> None:
    """Put the folder `tmp` (written whole) in place as `out`: every file and folder below it fsynced,
    renamed over `out` (an existing `out` goes to `tmp + ".old"` first and is removed after), the
    parent fsynced so the rename survives. A failure raises `error` in one line naming `out`."""
    parent = os.path.dirname(os.path.abspath(out))
    try:
        sync_tree(tmp)
        if os.path.exists(out):
            old = tmp + ".old"
            os.replace(out, old)
            os.replace(tmp, out)
            sync_folder(parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
            sync_folder(parent)
    except OSError as e:
        raise disk_error(error, out, e) from None


def move_durably(src: str, dst: str, error: type[DiskError]) -> None:
    """Rename the file `src` (written and fsynced by the caller) over `dst`, and fsync the folders
    so the rename survives; a failure raises `error` in one line naming `dst`."""
    try:
        os.replace(src, dst)
        sync_folder(os.path.dirname(os.path.abspath(dst)))
        if os.path.dirname(os.path.abspath(src)) != os.path.dirname(os.path.abspath(dst)):
            sync_folder(os.path.dirname(os.path.abspath(src)))
    except OSError as e:
        raise disk_error(error, dst, e) from None
