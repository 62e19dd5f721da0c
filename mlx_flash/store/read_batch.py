"""The bookkeeping of a reader pool's requests (store/reader_pool.py): the `Batch` handle a caller
waits on, which counts its jobs down, keeps the first error and the I/O totals, and holds the batch's
plan and destination views while workers read; the `_Job` a worker takes from the pool's priority
queue (a batch's share of reads, run back to back); and `_scatter_rows`, which lands a coalesced
read's ranges in a batch's row matrix."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np


class Batch:
    """Handle for a submitted batch: wait() blocks until every range is read or one failed."""

    def __init__(self, n_jobs: int):
        self._left = n_jobs
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.bytes_read = 0  # bytes fetched from the device, gaps and block padding included
        self.reads = 0
        self.io_seconds = 0.0  # summed over workers
        self.wait_seconds = 0.0  # time the caller spent blocked in wait()
        # Set by the pool at submit: the batch's files, read plan and destination views.
        self._files, self._plan, self._views, self._rows = [], None, None, None
        self._offset = self._length = self._dest = self._dest_offset = None
        if n_jobs == 0:
            self._done.set()

    def _finish_job(self, error: BaseException | None, nbytes: int, reads: int, seconds: float) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self.bytes_read += nbytes
            self.reads += reads
            self.io_seconds += seconds
            self._left -= 1
            if self._left == 0:  # also after an error: no worker may still write into the buffers
                # Drop the views on the destinations before waking the caller, who may then unmap them.
                self._views = self._rows = None
                self._done.set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> "Batch":
        t = time.perf_counter()
        if not self._done.wait(timeout):
            raise TimeoutError(f"read batch not finished after {timeout} s")
        self.wait_seconds += time.perf_counter() - t
        if self._error is not None:
            raise self._error
        return self


@dataclass(order=True, slots=True)
class _Job:
    priority: int
    seq: int
    batch: "Batch | None" = field(compare=False)
    # Reads one worker runs back to back: (straight, fd, start, length, dest index, dest offset,
    # read index). None: worker exit sentinel.
    reads: list | None = field(compare=False)


def _scatter_rows(rows: np.ndarray, p, first: int, count: int, scratch: np.ndarray, shift: int) -> None:
    """Copy a read's ranges from scratch into a row matrix, one numpy gather per (column, length)
    group: range r's bytes start at scratch[offset[r] + shift] and land in row dest_offset // width
    at column dest_offset % width."""
    from numpy.lib.stride_tricks import sliding_window_view

    r = slice(first, first + count)
    src = p.offset[r] + shift
    length = p.length[r]
    row, col = np.divmod(p.dest_offset[r], rows.shape[1])
    key = col * (rows.shape[1] + 1) + length
    for k in np.unique(key).tolist():
        sel = key == k
        c, n = divmod(k, rows.shape[1] + 1)
        rows[row[sel], c : c + n] = sliding_window_view(scratch, n)[src[sel]]
