"""Memory that reads land in: page-aligned anonymous memory (direct I/O reads straight into it), the
default of every reader that a backend does not hand its own allocator (`ops.host_buffer`: memory the
backend allocated, which its kernels read in place). Shared by store/, the sources and backends/,
importing none of them."""

from __future__ import annotations

import mmap

import numpy as np


def anonymous_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` of page-aligned anonymous memory as a writable uint8 view (the view keeps it alive);
    pages cost nothing until written."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]
