"""Whole positional reads and writes: os.pwrite and os.preadv may move fewer bytes than asked (a
signal, a large request), so each loops until every byte moved. Errors are the callers' to name."""

from __future__ import annotations

import os


def write_all(fd: int, data: memoryview, at: int) -> int:
    """Write every byte of `data` at offset `at` (OSError as raised); returns the bytes written."""
    total = data.nbytes
    while data.nbytes:
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n
    return total


def read_all(fd: int, view: memoryview, at: int) -> bool:
    """Fill `view` from offset `at`; False when the file ends first (OSError as raised)."""
    while view.nbytes:
        got = os.preadv(fd, [view], at)
        if got <= 0:
            return False
        view, at = view[got:], at + got
    return True
