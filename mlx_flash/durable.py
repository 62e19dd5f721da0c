"""Files written so that a crash or a power loss leaves either the old file or the whole new one:
the bytes go to a temporary sibling, which is fsynced, renamed over the target, and then the folder is
fsynced so the rename itself survives. A reader never finds a half-written file under the final name."""

from __future__ import annotations

import os

from .errors import FlashError


def write_durably(path: str, parts, error: type[FlashError]) -> None:
    """Write `parts` (bytes-like) to `path` durably. A failure removes the temporary and raises
    `error` naming the file and the cause (a full disk, a read-only folder)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for p in parts:
                view = memoryview(p)
                while view.nbytes:
                    n = os.write(fd, view)
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise error(f"{path}: cannot write it ({e.strerror or e})") from None
