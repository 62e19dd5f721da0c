"""Parallel reader pool: worker threads read lists of (file, offset, length) ranges into
caller-provided numpy destinations, bypassing the page cache (O_DIRECT on Linux, F_NOCACHE on
macOS) or through it (buffered mode).

How a batch is read:
1. Ranges are sorted per file and coalesced: two ranges whose gap is below `coalesce_gap` bytes become
   one read and the gap bytes are thrown away (reading a little more in one request is cheaper than
   another request; the gap comes from the disk profile). Chunks are split at `max_chunk` so big
   reads still spread across threads.
2. Chunks are dealt into jobs (two per worker); a worker reads a job's chunks back to back. For
   direct I/O each chunk is rounded out to the 4 KiB block and read into the worker's aligned
   scratch buffer, then the wanted bytes are copied out; a chunk that is already aligned in file and
   memory is read straight into its destination.
3. A batch completes when all its jobs are done; the first error (short read, EOF, EIO, closed
   file) is raised in every waiter with the file, offset and length. Workers never die on an error.

Several batches can be in flight; lower `priority` values are served first (the engine gives the
batch it is blocked on priority 0 and prefetches a larger number).
"""

from __future__ import annotations

import heapq
import itertools
import mmap
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..errors import FlashError

BLOCK = 4096
MODES = ("direct", "buffered")


class ReadError(FlashError):
    """A read failed: short read, EOF, I/O error, closed file or pool."""


class PoolClosedError(ReadError):
    """The pool was closed before or while the batch was read."""


@dataclass(slots=True)
class _Copy:
    dest: np.ndarray  # uint8, exactly `length` bytes
    at: int  # offset of these bytes inside the chunk
    length: int
    offset: int  # file offset (for messages)


@dataclass(slots=True)
class _Chunk:
    file: "PoolFile"
    start: int  # file offset of the first byte wanted
    end: int  # one past the last byte wanted
    copies: list[_Copy]
    batch: "Batch"
    # Set when the chunk is block-aligned and has one page-aligned destination: the worker reads
    # straight into it with this descriptor (the hot path: no copy, no per-read bookkeeping).
    into: np.ndarray | None = None
    fd: int = -1


class PoolFile:
    """A file opened for the pool: a direct-I/O descriptor when possible, plus a buffered one."""

    def __init__(self, path: str, direct: bool):
        self.path = path
        self.size = os.path.getsize(path)
        self.fd = os.open(path, os.O_RDONLY)
        self.direct_fd = None
        if direct:
            self.direct_fd = _open_direct(path)
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for fd in (self.fd, self.direct_fd):
                if fd is not None:
                    os.close(fd)


def _open_direct(path: str):
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
    # Chunks one worker reads back to back (a tight loop keeps per-read interpreter work, and so
    # time holding the GIL, close to a bare pread loop). None: worker exit sentinel.
    chunks: list | None = field(compare=False)


class ReaderPool:
    def __init__(self, threads: int = 4, mode: str = "direct", coalesce_gap: int = 0,
                 max_chunk: int = 1 << 20, name: str = "mlx-flash-reader"):
        if mode not in MODES:
            raise ValueError(f"reader mode {mode!r} is unknown (choose one of: {', '.join(MODES)})")
        if threads < 1:
            raise ValueError(f"threads must be >= 1 (got {threads})")
        self.mode = mode
        self.coalesce_gap = max(0, int(coalesce_gap))
        self.max_chunk = max(BLOCK, int(max_chunk) // BLOCK * BLOCK)
        self._files: list[PoolFile] = []
        self._queue: list[_Job] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._warned: set[str] = set()
        self._workers = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for w in self._workers:
            w.start()

    # ---- files -------------------------------------------------------------------------------
    def open(self, path: str) -> PoolFile:
        if self._closed:
            raise PoolClosedError(f"{path}: the reader pool is closed")
        f = PoolFile(path, direct=self.mode == "direct")
        if self.mode == "direct" and f.direct_fd is None and path not in self._warned:
            self._warned.add(path)
            warnings.warn(f"{path}: direct I/O is not available on this filesystem; reading through the page cache",
                          RuntimeWarning, stacklevel=2)
        self._files.append(f)
        return f

    # ---- batches -----------------------------------------------------------------------------
    def submit(self, ranges, priority: int = 0) -> Batch:
        """ranges: iterable of (PoolFile, offset, length, dest) with dest a writable uint8 array of
        at least `length` bytes. Returns a Batch at once; reading happens on the workers."""
        if self._closed:
            raise PoolClosedError("the reader pool is closed")
        items = []
        for f, off, length, dest in ranges:
            off, length = int(off), int(length)
            if f.closed:
                raise ReadError(f"{f.path}: file is closed (offset {off}, length {length})")
            if off < 0 or length < 0:
                raise ReadError(f"{f.path}: bad range offset {off}, length {length}")
            if dest.dtype != np.uint8 or dest.ndim != 1 or not dest.flags.c_contiguous or not dest.flags.writeable:
                raise ReadError(f"{f.path}: destination for offset {off} must be a writable contiguous uint8 vector")
            if dest.nbytes < length:
                raise ReadError(f"{f.path}: destination of {dest.nbytes} bytes is too small for {length} bytes "
                                f"at offset {off}")
            if length:
                items.append((f, off, length, dest[:length]))
        chunks = self._plan(items)
        # Two jobs per worker: enough to balance uneven chunks, few enough to keep overhead low.
        n_jobs = min(len(chunks), 2 * len(self._workers))
        batch = Batch(n_jobs)
        for c in chunks:
            c.batch = batch
        with self._cv:
            if self._closed:
                raise PoolClosedError("the reader pool is closed")
            for j in range(n_jobs):
                heapq.heappush(self._queue, _Job(priority, next(self._seq), chunks[j::n_jobs]))
            self._cv.notify(n_jobs)
        return batch

    def read(self, ranges, priority: int = 0) -> Batch:
        return self.submit(ranges, priority).wait()

    def _plan(self, items) -> list[_Chunk]:
        """Sort per file, merge ranges closer than coalesce_gap (overlaps always merge), split at
        max_chunk."""
        chunks: list[_Chunk] = []
        items = sorted(items, key=lambda i: (id(i[0]), i[1]))
        cur = None
        for f, off, length, dest in items:
            end = off + length
            if cur is not None and cur.file is f and off - cur.end <= self.coalesce_gap \
                    and max(end, cur.end) - cur.start <= self.max_chunk:
                cur.copies.append(_Copy(dest, off - cur.start, length, off))
                cur.end = max(cur.end, end)
                continue
            if length > self.max_chunk:  # one long range: split so several workers share it
                for s in range(0, length, self.max_chunk):
                    n = min(self.max_chunk, length - s)
                    chunks.append(_Chunk(f, off + s, off + s + n, [_Copy(dest[s:s + n], 0, n, off + s)], None))
                cur = None
                continue
            cur = _Chunk(f, off, end, [_Copy(dest, 0, length, off)], None)
            chunks.append(cur)
        if self.mode == "direct":
            for c in chunks:
                if c.file.direct_fd is not None and len(c.copies) == 1 and c.start % BLOCK == 0 \
                        and c.end % BLOCK == 0 and c.copies[0].dest.__array_interface__["data"][0] % BLOCK == 0:
                    c.into, c.fd = c.copies[0].dest, c.file.direct_fd
        return chunks

    # ---- workers -----------------------------------------------------------------------------
    def _work(self) -> None:
        scratch = mmap.mmap(-1, self.max_chunk + 2 * BLOCK)  # page-aligned, for direct I/O
        view = np.frombuffer(scratch, dtype=np.uint8)
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                job = heapq.heappop(self._queue)
            if job.chunks is None:
                return  # scratch is unmapped when its last view is collected
            self._run(job.chunks, view)

    def _run(self, chunks: list, view: np.ndarray) -> None:
        batch = chunks[0].batch
        t = time.perf_counter()
        nbytes, reads, c = 0, 0, chunks[0]
        try:
            preadv = os.preadv
            for c in chunks:
                if batch._error is not None:  # another job of this batch failed: skip the rest
                    break
                if c.into is not None:
                    got = preadv(c.fd, [c.into], c.start)
                    if got < c.end - c.start:
                        _check(c.file, c, got, c.end - c.start)
                    nbytes += got
                else:
                    nbytes += self._read_chunk(c, view)
                reads += 1
        except BaseException as e:  # noqa: BLE001 - every failure must reach the waiter
            if not isinstance(e, ReadError):
                e = ReadError(f"{c.file.path}: read of {c.end - c.start} bytes at offset {c.start} failed "
                              f"({type(e).__name__}: {e})")
            batch._finish_job(e, nbytes, reads, time.perf_counter() - t)
            return
        batch._finish_job(None, nbytes, reads, time.perf_counter() - t)

    def _read_chunk(self, c: _Chunk, scratch: np.ndarray) -> int:
        f = c.file
        if f.closed:
            raise ReadError(f"{f.path}: file was closed before offset {c.start} (length {c.end - c.start}) was read")
        want = c.end - c.start
        if f.direct_fd is not None and self.mode == "direct":
            a0 = c.start // BLOCK * BLOCK
            a1 = -(-c.end // BLOCK) * BLOCK
            got = _pread_full(f.direct_fd, scratch[: a1 - a0], a0, direct=True)
            _check(f, c, got - (c.start - a0), want)
            base = c.start - a0
        else:
            got = _pread_full(f.fd, scratch[:want], c.start)
            _check(f, c, got, want)
            base = 0
        for cp in c.copies:
            cp.dest[:] = scratch[base + cp.at: base + cp.at + cp.length]
        return got

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Fail queued work, stop and join every worker, close every descriptor."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            pending = [j.chunks for j in self._queue if j.chunks is not None]
            self._queue.clear()
            for _ in self._workers:
                heapq.heappush(self._queue, _Job(sys.maxsize, next(self._seq), None))
            self._cv.notify_all()
        for chunks in pending:
            c = chunks[0]
            c.batch._finish_job(PoolClosedError(f"{c.file.path}: the reader pool closed before offset {c.start} "
                                                f"(length {c.end - c.start}) was read"), 0, 0, 0.0)
        for w in self._workers:
            w.join()
        for f in self._files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pread_full(fd: int, buf: np.ndarray, offset: int, direct: bool = False) -> int:
    """pread until buf is full or EOF; returns the bytes read. A short direct read means EOF (a
    retry would start at an unaligned offset, which direct I/O refuses)."""
    n = buf.nbytes
    total = os.preadv(fd, [buf], offset)
    while total < n and not direct:
        got = os.preadv(fd, [memoryview(buf[total:])], offset + total)
        if got == 0:
            break
        total += got
    return total


def _check(f: PoolFile, c: _Chunk, got: int, want: int) -> None:
    if got < want:
        raise ReadError(f"{f.path}: short read at offset {c.start}: wanted {want} bytes, got {max(got, 0)} "
                        f"(file is {os.fstat(f.fd).st_size} bytes; truncated?)")
