"""The C allocator's part in the one memory limit (glibc; a no-op elsewhere).

glibc serves a request above its mmap threshold with a mapping of its own, handed back to the OS
on free, and anything smaller from its heaps, where a freed block stays in the process's RSS until
the memory around it is free too. By default the threshold moves: freeing a mapped block raises it
to that block's size (up to 32 MiB), so after the first large free the engine's large, short-lived
arrays (a layer's activations, a block's KV buffers, per-sequence caches copied into a batch) come
from the heaps and leave holes there. Measured in the throughput mode on a synthetic 7B-shape store
(torch, 2 blocks of 16 sequences, 2.4 GB cgroup): peak RSS 2.38 GB with the moving threshold,
1.90 GB with it fixed at 256 KiB, the second block's arrays reusing the first's instead of adding
to them; decode speed on the default model unchanged within noise (both backends).
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
LARGE = 256 << 10  # arrays above this are mapped on their own (fixing it also fixes the trim threshold)


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # glibc has both; musl has neither
        return libc
    except (OSError, AttributeError):
        return None


def map_large_arrays(threshold: int = LARGE) -> bool:
    """Serve every allocation above `threshold` bytes with its own mapping, returned to the OS when
    freed, for the rest of the process (see the module docstring). Whether it took effect."""
    libc = _glibc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1)


def return_free_memory() -> None:
    """Hand the heaps' free pages back to the OS, so RSS shows what the process holds (after a load
    frees large temporaries)."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)
