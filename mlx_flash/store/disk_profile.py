"""Disk profile: random-read throughput by chunk size and thread count, and latency to first byte,
measured through the reader pool with the page cache bypassed (LLM in a flash, Fig. 2b).

The engine reads the profile to size coalescing gaps (and later the cost model). Without a saved
profile, `default_profile()` runs a quick probe once and caches it.
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import time

import numpy as np

from ..durable import DurableFile, write_json
from ..errors import FlashError
from .atomic_dir import OutputError
from .reader_pool import BLOCK, ReaderPool
from ..config import default_cache_dir
from ..progress import step

KiB, MiB = 1024, 1024 * 1024
CHUNKS = [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB]
THREADS = [1, 2, 4, 8, 16, 32, 64]
PROFILE_NAME = "disk_profile.json"
QUICK_THREADS = [1, 4, 16]  # the first-use probe's thread counts


def make_scratch_file(path: str, size: int, progress: bool = False) -> str:
    """Random bytes (incompressible), written once and reused if already the right size."""
    if os.path.isfile(path) and os.path.getsize(path) == size:
        return path
    from tqdm import tqdm

    rng = np.random.default_rng(0)
    block = 4 * MiB  # small: the quick probe runs inside the caller's memory budget (64 MiB peaked 128 MiB over it)
    with (
        DurableFile(path, OutputError, needed=size) as fh,  # (reused by later runs: whole, or absent)
        tqdm(total=size, unit="B", unit_scale=True, desc="scratch file", disable=not progress) as bar,
    ):
        left = size
        while left:
            n = min(block, left)
            fh.write(rng.bytes(n))
            left -= n
            bar.update(n)
    return path


def random_offsets(rng, file_size: int, chunk: int, n: int, align: int = BLOCK) -> np.ndarray:
    return rng.integers(0, (file_size - chunk) // align, n) * align


def pool_throughput(
    path: str, chunk: int, threads: int, seconds: float, mode: str = "direct", seed: int = 0, align: int = BLOCK
) -> float:
    """Bytes/s of random `chunk`-sized reads at `align`-aligned offsets with `threads` workers,
    keeping two batches in flight so workers never wait for the submitter.

    The alignment matters on real drives: a read that straddles the device's internal unit costs
    more (measured here: 1 MiB reads at 1 MiB-aligned offsets ran 1.5x faster than at 4 KiB-aligned
    ones). The profile uses 4 KiB, what the engine's reads look like; comparisons with fio use the
    chunk size, fio's default `blockalign`."""
    size = os.path.getsize(path)
    rng = np.random.default_rng(seed)
    per_batch = max(32 * threads, 64)  # large batches: workers read back to back, like fio's loops
    with ReaderPool(threads=threads, mode=mode, coalesce_gap=0, max_chunk=max(chunk, BLOCK)) as pool:
        f = pool.open(path)
        # One chunk-sized landing slot per worker, reused like fio's per-job buffer: on a virtual disk
        # the host copies into guest memory, and a wider footprint alone costs 10-15% there.
        buf = mmap.mmap(-1, chunk * threads)  # page-aligned: reads land in place
        view = np.frombuffer(buf, dtype=np.uint8)
        slots = (np.arange(per_batch) % threads) * chunk

        def submit():
            offs = random_offsets(rng, size, chunk, per_batch, align)
            return pool.submit_rows(f, offs, chunk, view, slots)

        inflight = [submit(), submit()]
        done_bytes, k = 0, 0
        t0 = time.perf_counter()
        while True:
            inflight[k % 2].wait()
            done_bytes += chunk * per_batch
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
            inflight[k % 2] = submit()
            k += 1
        inflight[(k + 1) % 2].wait()
    return done_bytes / elapsed


def first_byte_latency(path: str, samples: int = 200, mode: str = "direct") -> float:
    """Median seconds for one 4 KiB random read issued alone."""
    size = os.path.getsize(path)
    rng = np.random.default_rng(1)
    out = []
    with ReaderPool(threads=1, mode=mode) as pool:
        f = pool.open(path)
        dest = np.empty(BLOCK, np.uint8)
        for off in random_offsets(rng, size, BLOCK, samples):
            t = time.perf_counter()
            pool.read([(f, int(off), BLOCK, dest)])
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def profile_disk(path: str, chunks=CHUNKS, threads=THREADS, seconds: float = 1.0, progress: bool = False) -> dict:
    """Measure random-read throughput of the drive holding `path` (an existing file; larger than the
    biggest chunk, ideally hundreds of MB) for every chunk size (bytes) x thread count, `seconds`
    each, through the reader pool with the page cache bypassed, and the latency of one 4 KiB read.

    Returns {"throughput": {threads: {chunk: bytes/s}} (keys are strings), "latency_s",
    "seconds_per_cell", "file", "file_size", "version", "created"}: the profile `best_threads` and
    `coalesce_gap` read, and what `python -m mlx_flash.profile_disk` saves for the engine."""
    from tqdm import tqdm

    grid = [(t, c) for t in threads for c in chunks]
    table: dict[str, dict[str, float]] = {}
    for t, c in tqdm(grid, desc="profiling", disable=not progress):
        table.setdefault(str(t), {})[str(c)] = pool_throughput(path, c, t, seconds)
    return {
        "version": 1,
        "file": os.path.abspath(path),
        "file_size": os.path.getsize(path),
        "seconds_per_cell": seconds,
        "throughput": table,
        "latency_s": first_byte_latency(path),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def coalesce_gap(profile: dict) -> int:
    """Largest gap worth reading through rather than issuing another request: the bytes the disk
    delivers during one request's latency at its best large-chunk rate, rounded down to blocks."""
    best = max(max(row.values()) for row in profile["throughput"].values())
    return int(profile["latency_s"] * best) // BLOCK * BLOCK


def best_threads(profile: dict, chunk: int) -> int:
    """Thread count with the highest throughput for the nearest measured chunk size."""
    sizes = sorted(int(c) for c in next(iter(profile["throughput"].values())))
    near = str(min(sizes, key=lambda s: abs(s - chunk)))
    return int(max(profile["throughput"], key=lambda t: profile["throughput"][t][near]))


def most_threads(cache_dir: str) -> int:
    """The most reader threads a pool sized by this machine's profile can get (for the memory plan,
    before any pool exists): the largest count the saved profile measured, else the quick probe's."""
    try:
        with open(os.path.join(cache_dir, PROFILE_NAME)) as fh:
            return max(int(t) for t in json.load(fh)["throughput"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return max(QUICK_THREADS)  # no profile yet (the probe runs when a pool is first made), or unreadable


def save_profile(profile: dict, path: str) -> None:
    write_json(path, profile, OutputError)


def plot_profile(profile: dict, png: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise FlashError("plotting the disk profile needs matplotlib (pip install matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t, row in sorted(profile["throughput"].items(), key=lambda kv: int(kv[0])):
        xs = sorted(int(c) for c in row)
        ax.plot([x / KiB for x in xs], [row[str(x)] / 1e9 for x in xs], marker="o", label=f"{t} threads")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size (KiB)")
    ax.set_ylabel("random read throughput (GB/s)")
    ax.set_title(f"random reads, page cache bypassed; latency {profile['latency_s'] * 1e6:.0f} us")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def default_profile(cache_dir: str | None = None, probe_dir: str | None = None, progress: bool = False) -> dict:
    """The disk profile load() sizes its reader pools with: the one saved in `cache_dir` (default:
    $MLX_FLASH_CACHE or ~/.cache/mlx_flash) by `python -m mlx_flash.profile_disk` or an earlier probe, or a
    quick probe (9 points of 0.25 s on a 256 MiB scratch file), run once and saved there."""

    cache_dir = cache_dir or default_cache_dir()
    path = os.path.join(cache_dir, PROFILE_NAME)
    if os.path.isfile(path):
        with open(path) as fh:
            return json.load(fh)
    os.makedirs(cache_dir, exist_ok=True)
    scratch = os.path.join(probe_dir or cache_dir, ".probe.bin")
    chunks, threads, seconds = [4 * KiB, 64 * KiB, 1 * MiB], QUICK_THREADS, 0.25
    detail = (
        f"first use: a 256 MiB scratch file, {len(chunks) * len(threads)} points of {seconds} s; saved to "
        f"{path}; python -m mlx_flash.profile_disk makes a full profile"
    )
    with step("measuring this disk's random reads", progress, detail):
        make_scratch_file(scratch, 256 * MiB)
        try:
            prof = profile_disk(scratch, chunks=chunks, threads=threads, seconds=seconds)
        finally:
            os.remove(scratch)
    prof["quick_probe"] = True
    save_profile(prof, path)
    return prof
