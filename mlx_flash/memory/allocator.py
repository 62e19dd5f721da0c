"""The C allocator's part in the one memory limit (glibc; a no-op elsewhere).

glibc serves small and mid-sized requests (below its mmap threshold, which moves up to 32 MiB as
large blocks are freed) from its heaps, where a freed block stays in the process's RSS until the
memory around it is free too. `return_free_memory` hands the heaps' free pages back to the OS
(malloc_trim), for the points where the engine has just freed a lot: after a load, and between the
throughput mode's blocks. Measured there (a synthetic 7B-shape store, torch, 2 blocks of 16
sequences, a 2.4 GB cgroup): without it the second block's arrays added to the first's holes in the
heaps, peak RSS 2.38 GB. Fixing the mmap threshold low instead (every array above 256 KiB mapped on
its own) also cured that, but slowed the sparse FFN's decode 3x (its per-token arrays mapped and
faulted in every token), so the threshold is left as glibc sets it.
"""

from __future__ import annotations

import ctypes
import sys


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # glibc has it; musl has not
        return libc
    except (OSError, AttributeError):
        return None


def return_free_memory() -> None:
    """Hand the heaps' free pages back to the OS, so RSS shows what the process holds."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)
