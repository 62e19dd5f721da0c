"""Parallel reader pool: worker threads read byte ranges of files into caller-provided numpy
destinations, bypassing the page cache (O_DIRECT on Linux, F_NOCACHE on macOS) or through it
(buffered mode).

How a batch is read:
1. The ranges are planned with numpy (`read_plan.py`): sorted per file, coalesced when the gap
   between them is at most `coalesce_gap` bytes (read a little more in one request rather than issue
   another; the gap comes from the disk profile), and cut at `max_chunk`.
2. The reads are dealt into jobs (two per worker); a worker runs a job's reads back to back in a
   tight loop, because on small blocks the interpreter time per read, serialised by the GIL, is what
   separates a Python reader from fio. A read of one range that is block-aligned in the file and in
   memory lands straight in its destination. Any other read goes through the worker's page-aligned
   scratch buffer (rounded out to the 4 KiB block for direct I/O) and the wanted bytes are copied out.
3. A batch completes when all its jobs are done (`read_batch.py`); the first error (short read, EOF,
   EIO, closed file) is raised in every waiter with the file, offset and length. Workers never die
   on an error.

Several batches can be in flight; lower `priority` values are served first (the engine gives the
batch it is blocked on priority 0 and prefetches a larger number).

Memory: the workers' scratch buffers share SCRATCH_BYTES (a read is cut at a worker's share, at most
`max_chunk`), so a pool holds at most `pool_bytes(threads)` whatever its thread count; the process
planner counts that for each pool a streaming engine opens. (Before the cap, each worker held a
whole `max_chunk`: 32 reader threads in two pools took 52 MB more than one, and a run at the planned
minimum passed its limit.)
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

import numpy as np

from .pool_file import PoolClosedError, PoolFile, ReadError, _check_dest, _check_file, _short  # noqa: F401
from .read_batch import Batch, _Job, _scatter_rows
from .read_plan import BLOCK, plan_reads

MODES = ("direct", "buffered")
SCRATCH_BYTES = 4 << 20  # all the workers' scratch buffers together (4 workers: 1 MiB each)
# What a worker thread holds beside its scratch (its stack's touched pages, the interpreter's thread
# state), rounded up from measurements of 45 to 50 KB a thread (64 threads in two pools against 1; 32 in one).
THREAD_BYTES = 128 << 10
_preadv = os.preadv  # module-level so fault tests can put a failing read underneath the workers


class ReaderPool:
    def __init__(
        self,
        threads: int = 4,
        mode: str = "direct",
        coalesce_gap: int = 0,
        max_chunk: int = 1 << 20,
        name: str = "mlx-flash-reader",
    ):
        if mode not in MODES:
            raise ValueError(f"reader mode {mode!r} is unknown (choose one of: {', '.join(MODES)})")
        if threads < 1:
            raise ValueError(f"threads must be >= 1 (got {threads})")
        self.mode = mode
        self.coalesce_gap = max(0, int(coalesce_gap))
        self.max_chunk = max(BLOCK, min(int(max_chunk), SCRATCH_BYTES // threads) // BLOCK * BLOCK)
        self._files: list[PoolFile] = []
        self._queue: list[_Job] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._warned: set[str] = set()
        self._workers = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for w in self._workers:
            w.start()

    @staticmethod
    def pool_bytes(threads: int, max_chunk: int = 1 << 20) -> int:
        """The most a pool of `threads` workers (made with `max_chunk`) holds: their scratch
        buffers and threads."""
        return threads * (min(max_chunk, SCRATCH_BYTES // threads) + 2 * BLOCK + THREAD_BYTES)

    @property
    def threads(self) -> int:
        return len(self._workers)

    # ---- files -------------------------------------------------------------------------------
    def open(self, path: str) -> PoolFile:
        if self._closed:
            raise PoolClosedError(f"{path}: the reader pool is closed")
        f = PoolFile(path, direct=self.mode == "direct")
        if self.mode == "direct" and f.direct_fd is None and path not in self._warned:
            self._warned.add(path)
            warnings.warn(
                f"{path}: direct I/O is not available on this filesystem; reading through the page cache",
                RuntimeWarning,
                stacklevel=2,
            )
        self._files.append(f)
        return f

    def close_file(self, f: PoolFile) -> None:
        """Close a file opened with open() once no batch reads it any more (a caller that opens many
        short-lived files, such as swap files, would otherwise hold their descriptors until close())."""
        with self._cv:
            if f in self._files:
                self._files.remove(f)
        f.close()

    # ---- batches -----------------------------------------------------------------------------
    def submit(self, ranges, priority: int = 0) -> Batch:
        """ranges: iterable of (PoolFile, offset, length, dest) with dest a writable contiguous uint8
        vector of at least `length` bytes. Returns a Batch at once; reading happens on the workers."""
        if self._closed:
            raise PoolClosedError("the reader pool is closed")
        files, index = [], {}
        fi, offs, lens, dests = [], [], [], []
        for f, off, length, dest in ranges:
            off, length = int(off), int(length)
            _check_file(f, off, length)
            if off < 0 or length < 0:
                raise ReadError(f"{f.path}: bad range offset {off}, length {length}")
            _check_dest(f, dest, off)
            if dest.nbytes < length:
                raise ReadError(
                    f"{f.path}: destination of {dest.nbytes} bytes is too small for {length} bytes at offset {off}"
                )
            if id(f) not in index:
                index[id(f)] = len(files)
                files.append(f)
            fi.append(index[id(f)])
            offs.append(off)
            lens.append(length)
            dests.append(dest)
        return self._submit(files, fi, offs, lens, dests, range(len(dests)), [0] * len(dests), priority)

    def submit_rows(
        self, f: PoolFile, offsets, lengths, dest: np.ndarray, dest_offsets, priority: int = 0, row_bytes: int = 0
    ) -> Batch:
        """Many ranges of one file into one destination buffer: range i is `lengths[i]` bytes at file
        offset `offsets[i]`, landing at byte `dest_offsets[i]` of `dest`. All arguments are arrays
        (or scalars for lengths), and nothing here loops per range.

        row_bytes: when dest is a matrix of rows this wide and no range crosses a row boundary, the
        workers copy a coalesced read's ranges out with a few numpy gathers instead of one copy per
        range (a token's FFN rows: thousands of ranges)."""
        if self._closed:
            raise PoolClosedError("the reader pool is closed")
        offsets = np.asarray(offsets, dtype=np.int64).ravel()
        lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), offsets.shape)
        dest_offsets = np.broadcast_to(np.asarray(dest_offsets, dtype=np.int64), offsets.shape)
        _check_file(f, int(offsets[0]) if offsets.size else 0, int(lengths[0]) if offsets.size else 0)
        _check_dest(f, dest, int(offsets[0]) if offsets.size else 0)
        bad = np.flatnonzero(
            (offsets < 0) | (lengths < 0) | (dest_offsets < 0) | (dest_offsets + lengths > dest.nbytes)
        )
        if bad.size:
            i = int(bad[0])
            raise ReadError(
                f"{f.path}: range {i} (offset {offsets[i]}, length {lengths[i]}) does not fit at byte "
                f"{dest_offsets[i]} of a {dest.nbytes}-byte destination"
            )
        rb = int(row_bytes)
        if rb and (dest.nbytes % rb or ((dest_offsets % rb) + lengths > rb).any()):
            rb = 0  # ranges straddle rows: copy them one by one
        return self._submit(
            [f],
            np.zeros(offsets.size, np.int64),
            offsets,
            lengths,
            [dest],
            np.zeros(offsets.size, np.int64),
            dest_offsets,
            priority,
            rb,
        )

    def read(self, ranges, priority: int = 0) -> Batch:
        return self.submit(ranges, priority).wait()

    def withdraw(self, batch: Batch) -> bool:
        """Take the batch's jobs that no worker has started off the queue (a prefetch no longer
        wanted must not hold a worker that a demand read could use). Returns True when some were
        taken: the batch then completes once its started jobs finish, and its destinations are not
        wholly written. False: every job had started, the batch will complete as submitted."""
        with self._cv:
            mine = [j for j in self._queue if j.batch is batch]
            if mine:
                self._queue = [j for j in self._queue if j.batch is not batch]
                heapq.heapify(self._queue)
        for _ in mine:
            batch._finish_job(None, 0, 0, 0.0)
        return bool(mine)

    def _submit(self, files, fi, offs, lens, dests, di, doffs, priority, row_bytes: int = 0) -> Batch:
        if self._closed:
            raise PoolClosedError("the reader pool is closed")
        plan = plan_reads(fi, offs, lens, di, doffs, self.coalesce_gap, self.max_chunk)
        n = plan.n_chunks
        n_jobs = min(n, 2 * len(self._workers))  # enough to balance uneven reads, few enough to stay cheap
        batch = Batch(n_jobs)
        if n_jobs == 0:
            return batch
        batch._files, batch._plan = files, plan
        batch._views = [memoryview(d) for d in dests]
        batch._rows = dests[0].reshape(-1, row_bytes) if row_bytes else None
        batch._offset, batch._length = plan.offset.tolist(), plan.length.tolist()
        batch._dest, batch._dest_offset = plan.dest.tolist(), plan.dest_offset.tolist()
        # Per read: descriptor, start, length, and whether it lands straight in its destination.
        direct = np.array([self.mode == "direct" and f.direct_fd is not None for f in files])[plan.c_file]
        fds = np.array(
            [f.direct_fd if self.mode == "direct" and f.direct_fd is not None else f.fd for f in files], dtype=np.int64
        )[plan.c_file]
        first = plan.c_first
        addr = (
            np.array([d.__array_interface__["data"][0] for d in dests], dtype=np.int64)[plan.dest[first]]
            + plan.dest_offset[first]
        )
        span = plan.c_end - plan.c_start
        aligned = (plan.c_start % BLOCK == 0) & (span % BLOCK == 0) & (addr % BLOCK == 0)
        straight = (plan.c_count == 1) & (aligned | ~direct)
        cols = [
            straight.tolist(),
            fds.tolist(),
            plan.c_start.tolist(),
            span.tolist(),
            plan.dest[first].tolist(),
            plan.dest_offset[first].tolist(),
            np.arange(n).tolist(),
        ]
        with self._cv:
            if self._closed:
                raise PoolClosedError("the reader pool is closed")
            for j in range(n_jobs):
                heapq.heappush(
                    self._queue, _Job(priority, next(self._seq), batch, list(zip(*(c[j::n_jobs] for c in cols))))
                )
            self._cv.notify(n_jobs)
        return batch

    # ---- workers -----------------------------------------------------------------------------
    def _work(self) -> None:
        scratch = mmap.mmap(-1, self.max_chunk + 2 * BLOCK)  # page-aligned, for direct I/O
        view = memoryview(scratch)
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                job = heapq.heappop(self._queue)
            if job.reads is None:
                view.release()
                scratch.close()
                return
            self._run(job, view)

    def _run(self, job: _Job, scratch: memoryview) -> None:
        batch = job.batch
        views = batch._views
        preadv = _preadv
        t = time.perf_counter()
        nbytes = nreads = 0
        c = job.reads[0][-1]
        try:
            for straight, fd, start, n, d, doff, c in job.reads:
                if batch._error is not None:  # another job of this batch failed: skip the rest
                    break
                if straight:  # the hot path: one range, read in place
                    got = preadv(fd, [views[d][doff : doff + n]], start)
                    if got < n:
                        got = self._finish_short(batch, c, fd, views[d][doff : doff + n], start, got)
                else:
                    got = self._read_via_scratch(batch, c, scratch)
                nbytes += got
                nreads += 1
            views = None  # the destinations may be unmapped as soon as the batch completes
        except BaseException as e:  # noqa: BLE001 - every failure must reach the waiter
            views = None
            if not isinstance(e, ReadError):
                p = batch._plan
                e = ReadError(
                    f"{batch._files[p.c_file[c]].path}: read of {p.c_end[c] - p.c_start[c]} bytes at offset "
                    f"{p.c_start[c]} failed ({type(e).__name__}: {e})"
                )
            # The traceback's frames hold views on the destinations; the message says what failed.
            e.__context__ = None
            e = e.with_traceback(None)
            batch._finish_job(e, nbytes, nreads, time.perf_counter() - t)
            return
        batch._finish_job(None, nbytes, nreads, time.perf_counter() - t)

    def _finish_short(self, batch: Batch, c: int, fd: int, dest: memoryview, start: int, got: int) -> int:
        """A straight read came back short: buffered reads retry the rest; direct reads stop (a
        retry would start unaligned), and a read still short is an error naming the range."""
        f = batch._files[batch._plan.c_file[c]]
        if fd != f.direct_fd:
            got += _pread_full(fd, dest[got:], start + got)
        if got < len(dest):
            _short(f, start, len(dest), got)
        return got

    def _read_via_scratch(self, batch: Batch, c: int, scratch: memoryview) -> int:
        p = batch._plan
        f = batch._files[p.c_file[c]]
        start, end = int(p.c_start[c]), int(p.c_end[c])
        if f.closed:
            raise ReadError(f"{f.path}: file was closed before offset {start} (length {end - start}) was read")
        if self.mode == "direct" and f.direct_fd is not None:
            a0, a1 = start // BLOCK * BLOCK, -(-end // BLOCK) * BLOCK
            got = _preadv(f.direct_fd, [scratch[: a1 - a0]], a0)
            if got - (start - a0) < end - start:
                _short(f, start, end - start, got - (start - a0))
            base = start - a0
        else:
            got = _pread_full(f.fd, scratch[: end - start], start)
            if got < end - start:
                _short(f, start, end - start, got)
            base = 0
        first, count = int(p.c_first[c]), int(p.c_count[c])
        if batch._rows is not None and count > 8:
            _scatter_rows(batch._rows, p, first, count, np.frombuffer(scratch, dtype=np.uint8), base - start)
            return got
        views, off, length = batch._views, batch._offset, batch._length
        dest, doff = batch._dest, batch._dest_offset
        for r in range(first, first + count):
            at = base + off[r] - start
            views[dest[r]][doff[r] : doff[r] + length[r]] = scratch[at : at + length[r]]
        return got

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Fail queued work, stop and join every worker, close every descriptor."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            pending = [j for j in self._queue if j.reads is not None]
            self._queue.clear()
            for _ in self._workers:
                heapq.heappush(self._queue, _Job(sys.maxsize, next(self._seq), None, None))
            self._cv.notify_all()
        for job in pending:
            _, _, start, n, _, _, c = job.reads[0]
            path = job.batch._files[job.batch._plan.c_file[c]].path
            job.batch._finish_job(
                PoolClosedError(f"{path}: the reader pool closed before offset {start} (length {n}) was read"),
                0,
                0,
                0.0,
            )
        for w in self._workers:
            w.join()
        for f in self._files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Buffered pread until buf is full or EOF; returns the bytes read."""
    total, n = 0, len(buf)
    while total < n:
        got = _preadv(fd, [buf[total:]], offset + total)
        if got == 0:
            break
        total += got
    return total
