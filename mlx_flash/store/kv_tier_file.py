"""One sequence's older keys and values on flash (the KV tiers of models/kv_tiers.py): a file laid out
head-major, [layers, 2 (keys, values), kv_heads, capacity, head_dim] float32, so the tokens a layer
moves out of its resident window are one write per head, and the tokens [0, n) of a layer, what its
attention reads back, are one read per head straight into a read buffer of the same layout.

The file is created in `folder` (mode 0600) and unlinked at once: it has no name while the process
holds it, so a run killed at any point leaves nothing on disk and needs no clean-up. Its size is
reserved when made (posix_fallocate), so a full disk is said at the start, naming the bytes, not at
the k-th token. Bytes only: no framework array is touched (the read buffers are numpy views of memory
the backend allocated).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from ..errors import FlashError
from ..units import fmt
from .positional_io import read_all, write_all

_F32 = 4


class KVTierError(FlashError):
    """The file of a sequence's older KV could not be made, written or read (full disk, permissions)."""


class KVTierFile:
    """Tokens [0, capacity) of every layer's keys and values of one sequence (see the module docstring)."""

    def __init__(self, folder: str, layers: int, kv_heads: int, head_dim: int, capacity: int):
        self.layers, self.kv_heads, self.head_dim, self.capacity = layers, kv_heads, head_dim, capacity
        self.nbytes = layers * 2 * kv_heads * capacity * head_dim * _F32
        self.fd = -1
        try:
            os.makedirs(folder, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="kv-", suffix=".tier", dir=folder)
        except OSError as e:
            raise KVTierError(f"KV on flash under {folder}: cannot create a file there ({e.strerror})") from None
        os.unlink(path)  # nameless from here: the kernel frees it when the process lets it go
        self.fd, self.where = fd, folder
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            self.close()
            raise KVTierError(
                f"KV on flash under {folder}: cannot reserve {fmt(self.nbytes)} for {capacity} tokens ({e.strerror})"
            ) from None
        self.bytes_written = 0

    def _at(self, layer: int, which: int, head: int, token: int) -> int:
        return (((layer * 2 + which) * self.kv_heads + head) * self.capacity + token) * self.head_dim * _F32

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Tokens [start, start + T) of one layer: k, v float32 [kv_heads, T, head_dim] (any strides)."""
        T = k.shape[1]
        if start < 0 or start + T > self.capacity:
            raise ValueError(f"tokens [{start}, {start + T}) are outside the file's {self.capacity}")
        for which, kv in enumerate((k, v)):
            for h in range(self.kv_heads):
                data = memoryview(np.ascontiguousarray(kv[h], np.float32)).cast("B")
                try:
                    self.bytes_written += write_all(self.fd, data, self._at(layer, which, h, start))
                except OSError as e:
                    raise KVTierError(f"KV on flash under {self.where}: cannot write it ({e.strerror})") from None

    def read_into(self, layer: int, start: int, n: int, k_out: np.ndarray, v_out: np.ndarray, pool=None) -> None:
        """Tokens [start, n) of one layer into k_out[:, start:n], v_out[:, start:n] (float32 [kv_heads,
        cap >= n, head_dim], each head's tokens contiguous, as a read buffer is laid out): one read
        per head, run by `pool` (an executor) side by side when given: one read at a time gets a
        fraction of what a drive gives to several in flight."""
        jobs = [
            (memoryview(out[h, start:n]).cast("B"), self._at(layer, which, h, start))
            for which, out in enumerate((k_out, v_out))
            for h in range(self.kv_heads)
        ]
        if pool is None:
            for view, at in jobs:
                self._read(view, at, n)
        else:
            for f in [pool.submit(self._read, view, at, n) for view, at in jobs]:
                f.result()

    def _read(self, view: memoryview, at: int, n: int) -> None:
        try:
            whole = read_all(self.fd, view, at)
        except OSError as e:
            raise KVTierError(f"KV on flash under {self.where}: cannot read it ({e.strerror})") from None
        if not whole:
            raise KVTierError(f"KV on flash under {self.where}: the file ends before token {n}")

    def __del__(self):  # caches dropped without release(): the descriptor (so the disk) goes with them
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
