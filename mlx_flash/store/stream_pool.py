"""The reader pool a streaming FFN source reads through, sized by the disk profile."""

from __future__ import annotations

from .disk_profile import best_threads, coalesce_gap, default_profile
from .reader_pool import ReaderPool


def stream_pool(cache_dir: str, chunk: int, mode: str = "direct", threads: int | None = None,
                progress: bool = False) -> ReaderPool:
    """A pool for reads of about `chunk` bytes: `threads` (default: the profile's best count for
    that size) and the profile's coalescing gap. The first use on a machine measures the disk (a few
    seconds, said on stderr when `progress`)."""
    profile = default_profile(cache_dir, progress=progress)
    return ReaderPool(threads=threads or best_threads(profile, min(chunk, 1 << 20)), mode=mode,
                      coalesce_gap=coalesce_gap(profile))
