"""The reader pool a streaming FFN source reads through, sized by the disk profile."""

from __future__ import annotations

from .disk_profile import best_threads, coalesce_gap, default_profile, most_threads
from .reader_pool import ReaderPool

# A streaming engine opens at most this many pools at once: one for the layers whose attention
# streams (layer_stream.LayerSlots) and one for the FFN (streamed, sparse or experts).
STREAM_POOLS = 2


def stream_pool(
    cache_dir: str, chunk: int, mode: str = "direct", threads: int | None = None, progress: bool = False
) -> ReaderPool:
    """A pool for reads of about `chunk` bytes: `threads` (default: the profile's best count for
    that size) and the profile's coalescing gap. The first use on a machine measures the disk (a few
    seconds, said on stderr when `progress`)."""
    profile = default_profile(cache_dir, progress=progress)
    return ReaderPool(
        threads=threads or best_threads(profile, min(chunk, 1 << 20)), mode=mode, coalesce_gap=coalesce_gap(profile)
    )


def stream_pools_bytes(cache_dir: str, threads: int | None = None) -> int:
    """The most the stream pools of one engine hold (for the memory plan, made before them)."""
    return STREAM_POOLS * ReaderPool.pool_bytes(threads or most_threads(cache_dir))
