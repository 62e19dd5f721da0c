"""Which stores a live process holds, and when each was last used.

An engine that opens a store takes a shared lock (flock) on `.NAME.in-use` beside it and holds it
while the Store lives; the file's mtime is the store's last use. Removing a store takes the lock
exclusively without waiting, so a store in use is refused, never pulled from under an engine. A
conversion holds `.NAME.lock` (atomic_dir.output_lock) the same way. Where the folder is read-only
(a store the user keeps elsewhere) nothing is recorded: nobody here may remove it either.
"""

from __future__ import annotations

import fcntl
import os
from typing import IO

from ..errors import StoreError


def in_use_path(store_dir: str) -> str:
    store_dir = os.path.abspath(store_dir)
    return os.path.join(os.path.dirname(store_dir), f".{os.path.basename(store_dir)}.in-use")


def conversion_lock_path(store_dir: str) -> str:
    """The lock a conversion into `store_dir` holds (atomic_dir.output_lock's file)."""
    store_dir = os.path.abspath(store_dir)
    return os.path.join(os.path.dirname(store_dir), f".{os.path.basename(store_dir)}.lock")


def hold(store_dir: str) -> IO | None:
    """A shared hold of `store_dir` for as long as the returned file stays open (None: the folder
    takes no lock file). Marks the store used now."""
    path = in_use_path(store_dir)
    try:
        f = open(path, "a")  # (not durable: a lock, no data; its mtime is a hint)
    except OSError:
        return None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise StoreError(f"{store_dir}: the store is being removed") from None
    try:
        os.utime(path)
    except OSError:
        pass
    return f


def try_exclusive(path: str) -> IO | None:
    """The lock file `path` held exclusively, or None when another process holds it (a missing
    file is created, and so free)."""
    try:
        f = open(path, "a")  # (not durable: a lock, no data; its mtime is a hint)
    except OSError as e:
        raise StoreError(f"{path}: cannot open the lock ({e.strerror})") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f
