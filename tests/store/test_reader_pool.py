"""Reader pool: exact bytes in every mode (property test), and faults that surface promptly as named
errors without leaking threads or descriptors."""

import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_flash.store.reader_pool import PoolClosedError, ReaderPool, ReadError

FILE_SIZE = 3 * 4096 + 1234  # not block-aligned: ranges can touch a ragged EOF


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "data.bin"
    payload = np.random.default_rng(0).integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    return str(path), payload


def ranges_strategy():
    one = st.tuples(st.integers(0, FILE_SIZE), st.integers(0, 9000)).map(lambda t: (t[0], min(t[1], FILE_SIZE - t[0])))
    return st.lists(one, min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    ranges=ranges_strategy(),
    mode=st.sampled_from(["direct", "buffered"]),
    threads=st.sampled_from([1, 3]),
    gap=st.sampled_from([0, 100, 8192]),
    max_chunk=st.sampled_from([4096, 1 << 20]),
)
def test_bytes_equal_pread(data_file, ranges, mode, threads, gap, max_chunk):
    path, payload = data_file
    with ReaderPool(threads=threads, mode=mode, coalesce_gap=gap, max_chunk=max_chunk) as pool:
        f = pool.open(path)
        dests = [np.full(n, 0xAB, dtype=np.uint8) for _, n in ranges]
        pool.read([(f, off, n, d) for (off, n), d in zip(ranges, dests)])
        fd = os.open(path, os.O_RDONLY)
        try:
            for (off, n), d in zip(ranges, dests):
                assert d.tobytes() == os.pread(fd, n, off)
        finally:
            os.close(fd)


def test_aligned_range_lands_in_aligned_destination(data_file):
    import mmap

    path, payload = data_file
    buf = mmap.mmap(-1, 8192)
    dest = np.frombuffer(buf, dtype=np.uint8)
    with ReaderPool(threads=2, mode="direct") as pool:
        pool.read([(pool.open(path), 4096, 8192, dest)])
    assert dest.tobytes() == payload[4096:12288]
    del dest
    buf.close()


def threads_named(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def fd_count():
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None


def test_file_truncated_under_the_reader(tmp_path):
    path = tmp_path / "shrinks.bin"
    path.write_bytes(b"x" * 5 * 4096)
    before = fd_count()
    pool = ReaderPool(threads=2, mode="direct", name="trunc")
    f = pool.open(str(path))
    os.truncate(path, 4096)
    t = time.perf_counter()
    with pytest.raises(ReadError, match=r"shrinks\.bin: short read at offset 8192"):
        pool.read([(f, 8192, 4096, np.empty(4096, np.uint8))])
    assert time.perf_counter() - t < 1.0
    pool.close()
    assert not threads_named("trunc") and fd_count() == before


def test_closed_pool(data_file):
    path, _ = data_file
    pool = ReaderPool(threads=2, name="closed")
    f = pool.open(path)
    pool.close()
    t = time.perf_counter()
    with pytest.raises(PoolClosedError, match="closed"):
        pool.submit([(f, 0, 10, np.empty(10, np.uint8))])
    with pytest.raises(PoolClosedError):
        pool.open(path)
    assert time.perf_counter() - t < 1.0
    assert not threads_named("closed")


def test_destination_too_small(data_file):
    path, _ = data_file
    with ReaderPool(threads=1) as pool:
        with pytest.raises(ReadError, match=r"destination of 10 bytes is too small for 100 bytes at offset 5"):
            pool.submit([(pool.open(path), 5, 100, np.empty(10, np.uint8))])
        with pytest.raises(ReadError, match="writable contiguous uint8"):
            pool.submit([(pool.open(path), 5, 10, np.empty(10, np.float32))])


def test_worker_that_raises(data_file, monkeypatch):
    import mlx_flash.store.reader_pool as rp

    path, _ = data_file
    pool = ReaderPool(threads=2, name="boom")

    def broken(fd, bufs, offset):
        raise RuntimeError("simulated EIO")

    monkeypatch.setattr(rp, "_preadv", broken)
    f = pool.open(path)
    t = time.perf_counter()
    with pytest.raises(
        ReadError, match=r"data\.bin: read of 100 bytes at offset 7 failed \(RuntimeError: simulated EIO\)"
    ):
        pool.read([(f, 7, 100, np.empty(100, np.uint8))])
    assert time.perf_counter() - t < 1.0
    monkeypatch.undo()
    d = np.empty(100, np.uint8)
    pool.read([(f, 7, 100, d)])  # the workers survived the failure
    pool.close()
    assert not threads_named("boom")


def gated_reads(monkeypatch) -> tuple[threading.Event, list]:
    """The pool's reads wait for the returned gate (5 s at most); the list gets each read's offset."""
    import mlx_flash.store.reader_pool as rp

    gate, offsets = threading.Event(), []

    def slow(fd, bufs, offset):
        offsets.append(offset)
        gate.wait(5)
        return os.preadv(fd, bufs, offset)

    monkeypatch.setattr(rp, "_preadv", slow)
    return gate, offsets


def test_close_fails_queued_batches(data_file, monkeypatch):
    path, _ = data_file
    pool = ReaderPool(threads=1, name="queued")
    f = pool.open(path)
    gate, _ = gated_reads(monkeypatch)
    first = pool.submit([(f, 0, 10, np.empty(10, np.uint8))])
    time.sleep(0.05)  # the only worker is now blocked inside `first`
    second = pool.submit([(f, 100, 10, np.empty(10, np.uint8))])
    closer = threading.Thread(target=pool.close)
    closer.start()
    with pytest.raises(PoolClosedError):
        second.wait(timeout=1.0)
    gate.set()
    first.wait(timeout=1.0)
    closer.join(2)
    assert not closer.is_alive() and not threads_named("queued")


def test_priority_serves_urgent_batch_first(data_file, monkeypatch):
    import mlx_flash.store.reader_pool as rp

    path, _ = data_file
    with ReaderPool(threads=1, max_chunk=4096, mode="buffered") as pool:
        f = pool.open(path)
        order = []

        def record(fd, bufs, offset):
            order.append(offset)
            time.sleep(0.01)
            return os.preadv(fd, bufs, offset)

        monkeypatch.setattr(rp, "_preadv", record)
        big = np.empty(3 * 4096, np.uint8)
        low = pool.submit([(f, 0, 3 * 4096, big)], priority=5)
        urgent = pool.submit([(f, 3 * 4096, 1000, np.empty(1000, np.uint8))], priority=0)
        urgent.wait(2)
        low.wait(2)
        assert order.index(3 * 4096) < 3  # served before the low-priority batch finished


def test_a_withdrawn_batch_leaves_the_queue_and_completes_without_its_reads(data_file, monkeypatch):
    path, _ = data_file
    with ReaderPool(threads=1, mode="buffered") as pool:
        f = pool.open(path)
        gate, offsets = gated_reads(monkeypatch)
        running = pool.submit([(f, 0, 10, np.empty(10, np.uint8))])
        time.sleep(0.05)  # the only worker is now inside `running`
        dest = np.full(100, 0xAB, np.uint8)
        queued = pool.submit([(f, 200, 100, dest)], priority=1)
        assert pool.withdraw(queued) is True
        assert queued.wait(timeout=1.0).bytes_read == 0 and (dest == 0xAB).all()
        gate.set()
        assert pool.withdraw(running) is False  # already started: it completes as submitted
        assert running.wait(timeout=1.0).bytes_read == 10
        assert 200 not in offsets


def test_direct_io_refused_falls_back_with_a_warning(tmp_path, monkeypatch):
    import mlx_flash.store.pool_file as pool_file

    path = tmp_path / "f.bin"
    path.write_bytes(b"abc" * 5000)
    monkeypatch.setattr(pool_file, "open_direct", lambda p: None)
    with ReaderPool(threads=1, mode="direct") as pool:
        with pytest.warns(RuntimeWarning, match="direct I/O is not available"):
            f = pool.open(str(path))
        d = np.empty(6, np.uint8)
        pool.read([(f, 3, 6, d)])
        assert d.tobytes() == b"abcabc"


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, FILE_SIZE - 1), st.integers(1, 5000)), min_size=1, max_size=40),
    mode=st.sampled_from(["direct", "buffered"]),
    gap=st.sampled_from([0, 300, 8192]),
    max_chunk=st.sampled_from([4096, 1 << 20]),
)
def test_rows_into_one_buffer_equal_pread(data_file, rows, mode, gap, max_chunk):
    """submit_rows: many ranges of one file packed back to back into one destination."""
    path, payload = data_file
    offs = np.array([o for o, _ in rows])
    lens = np.minimum([n for _, n in rows], FILE_SIZE - offs)
    at = np.concatenate([[0], np.cumsum(lens)[:-1]])
    dest = np.full(int(lens.sum()), 0xAB, dtype=np.uint8)
    with ReaderPool(threads=3, mode=mode, coalesce_gap=gap, max_chunk=max_chunk) as pool:
        pool.submit_rows(pool.open(path), offs, lens, dest, at).wait()
    assert dest.tobytes() == b"".join(payload[o : o + n] for o, n in zip(offs, lens))


def test_rows_that_do_not_fit_are_refused(data_file):
    path, _ = data_file
    with ReaderPool(threads=1) as pool:
        f = pool.open(path)
        with pytest.raises(ReadError, match=r"range 1 \(offset 50, length 20\) does not fit at byte 90 of a 100-byte"):
            pool.submit_rows(f, [0, 50], 20, np.empty(100, np.uint8), [0, 90])


@settings(max_examples=40, deadline=None)
@given(
    picks=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 2)), min_size=1, max_size=60, unique_by=lambda t: t),
    mode=st.sampled_from(["direct", "buffered"]),
    gap=st.sampled_from([0, 4096]),
)
def test_rows_with_fields_into_a_row_matrix_equal_pread(data_file, picks, mode, gap):
    """The row-matrix fast copy: field k (width 40) of record i -> row slot, column 40 * k."""
    path, payload = data_file
    width = 120
    rows = np.full((len(picks), width), 0xAB, dtype=np.uint8)
    offs = np.array([i * 200 + k * 40 for i, k in picks])
    dest = np.array([slot * width + k * 40 for slot, (_, k) in enumerate(picks)])
    with ReaderPool(threads=2, mode=mode, coalesce_gap=gap) as pool:
        pool.submit_rows(pool.open(path), offs, 40, rows.reshape(-1), dest, row_bytes=width).wait()
    for slot, (i, k) in enumerate(picks):
        assert rows[slot, k * 40 : (k + 1) * 40].tobytes() == payload[i * 200 + k * 40 : i * 200 + (k + 1) * 40]


_POOL_RSS = """
import sys
import numpy as np
from mlx_flash.memory import process_rss
from mlx_flash.store.reader_pool import ReaderPool

path, threads, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
payload = np.fromfile(path, dtype=np.uint8)
ranges = [(1 + (i * 4096) % (size // 2), size // 2) for i in range(4 * threads)]
dests = [np.ones(n, dtype=np.uint8) for _, n in ranges]  # touched before the baseline
before = process_rss()
with ReaderPool(threads=threads, mode="buffered") as pool:
    f = pool.open(path)
    pool.read([(f, off, n, d) for (off, n), d in zip(ranges, dests)])
    grown = process_rss() - before
assert all(np.array_equal(d, payload[off:off + n]) for (off, n), d in zip(ranges, dests))
print(grown)
"""


@pytest.mark.skipif(not os.path.isfile("/proc/self/status"), reason="RSS read from /proc")
def test_many_threads_hold_at_most_pool_bytes(tmp_path):
    """Every worker reads through its scratch buffer (the ranges start off the block grid): the pool's
    growth in RSS stays within pool_bytes(threads), however many threads (each worker used to hold a
    whole max_chunk). Measured in a fresh process, whose RSS nothing else moves."""
    import subprocess
    import sys

    threads, size = 32, 8 << 20
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes())
    r = subprocess.run(
        [sys.executable, "-c", _POOL_RSS, str(path), str(threads), str(size)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    grown = int(r.stdout.split()[-1])
    assert grown <= ReaderPool.pool_bytes(threads), (grown, ReaderPool.pool_bytes(threads))
