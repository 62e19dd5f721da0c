"""Files as the reader pool holds them (a direct-I/O descriptor when the filesystem allows one, and
a buffered one), the pool's errors, and the checks a range passes before it is read."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np

from ..errors import DiskError
from .read_plan import BLOCK


class ReadError(DiskError):
    """A read failed: short read, EOF, I/O error, closed file or pool."""


class PoolClosedError(ReadError):
    """The pool was closed before or while the batch was read."""


class PoolFile:
    """A file opened for the pool: a direct-I/O descriptor when possible, plus a buffered one."""

    def __init__(self, path: str, direct: bool):
        self.path = path
        self.size = os.path.getsize(path)
        self.fd = os.open(path, os.O_RDONLY)
        self.direct_fd = None
        if direct:
            self.direct_fd = open_direct(path)
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for fd in (self.fd, self.direct_fd):
                if fd is not None:
                    os.close(fd)


def open_direct(path: str):
    """A descriptor that bypasses the page cache, or None if the filesystem refuses."""
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return None
        try:  # some filesystems accept the flag at open and fail at the first read
            buf = mmap.mmap(-1, BLOCK)
            os.preadv(fd, [buf], 0)
            buf.close()
        except OSError:
            os.close(fd)
            return None
        return fd
    if sys.platform == "darwin":
        import fcntl

        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
        except OSError:
            os.close(fd)
            return None
        return fd
    return None


def _check_file(f: PoolFile, off: int, length: int) -> None:
    if f.closed:
        raise ReadError(f"{f.path}: file is closed (offset {off}, length {length})")


def _check_dest(f: PoolFile, dest: np.ndarray, off: int) -> None:
    if dest.dtype != np.uint8 or dest.ndim != 1 or not dest.flags.c_contiguous or not dest.flags.writeable:
        raise ReadError(f"{f.path}: destination for offset {off} must be a writable contiguous uint8 vector")


def _short(f: PoolFile, start: int, want: int, got: int) -> None:
    raise ReadError(
        f"{f.path}: short read at offset {start}: wanted {want} bytes, got {max(got, 0)} "
        f"(file is {os.fstat(f.fd).st_size} bytes; truncated?)"
    )
