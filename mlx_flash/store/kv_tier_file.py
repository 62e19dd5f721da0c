"""One sequence's older keys and values on flash (the KV tiers of models/kv_tiers.py): a file laid out
head-major, [layers, 2 (keys, values), kv_heads, capacity, head_dim] float32, so the tokens a layer
moves out of its resident window are one write per head, and the tokens [0, n) of a layer, what its
attention reads back, are one read per head straight into a read buffer of the same layout.

Compressed, a sequence's tokens are blocks of codes instead (KVBlockFile, laid out [layers, blocks]:
a layer's tokens [0, n) are one range, read in parts side by side).

The file is created in `folder` (mode 0600) and unlinked at once: it has no name while the process
holds it, so a run killed at any point leaves nothing on disk and needs no clean-up. Its size is
reserved when made (posix_fallocate), so a full disk is said at the start, naming the bytes, not at
the k-th token. Reads bypass the page cache where the file system allows it (a second descriptor
opened O_DIRECT, pool_file.open_direct) and a read is aligned (its buffer, offset and length on
BLOCK bytes; the read buffers are page-aligned and the ranges start on a 64-token step): each
decoded token reads every token on flash once, so a cache of them would only be copied through and
reclaimed, inside a memory limit that is the reason they are on flash. Bytes only: no framework
array is touched (the read buffers are numpy views of memory the backend allocated).
"""

from __future__ import annotations

import errno
import os
import tempfile

import numpy as np

from ..durable import disk_error, file_in_the_way
from ..errors import DiskError
from ..units import fmt
from .pool_file import open_direct
from .positional_io import read_all, write_all
from .read_plan import BLOCK

_F32 = 4
READ_PARTS = 8  # a block file's range is read in this many parts side by side


class KVTierError(DiskError):
    """The file of a sequence's older KV could not be made, written or read (full disk, permissions)."""


class _NamelessFile:
    """A file of `nbytes` reserved under `folder` with no name (see the module docstring)."""

    def __init__(self, folder: str, nbytes: int, capacity: int):
        self.fd, self.direct_fd, self.nbytes, self.capacity, self.bytes_written = -1, None, nbytes, capacity, 0
        self.fd, self.direct_fd, self.where = _reserved(folder, nbytes, capacity)

    def __del__(self):  # caches dropped without release(): the descriptors (so the disk) go with them
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None


class KVTierFile(_NamelessFile):
    """Tokens [0, capacity) of every layer's keys and values of one sequence (see the module docstring)."""

    def __init__(self, folder: str, layers: int, kv_heads: int, head_dim: int, capacity: int):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        super().__init__(folder, layers * 2 * kv_heads * capacity * head_dim * _F32, capacity)

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
                    raise disk_error(KVTierError, self.where, e, said="KV on flash") from None

    def read_into(self, layer: int, start: int, n: int, k_out: np.ndarray, v_out: np.ndarray, pool=None) -> None:
        """Tokens [start, n) of one layer into k_out[:, start:n], v_out[:, start:n] (float32 [kv_heads,
        cap >= n, head_dim], each head's tokens contiguous, as a read buffer is laid out): one read
        per head, run by `pool` (an executor) side by side when given: one read at a time gets a
        fraction of what a drive gives to several in flight. The bytes read."""
        jobs = [
            (memoryview(out[h, start:n]).cast("B"), self._at(layer, which, h, start))
            for which, out in enumerate((k_out, v_out))
            for h in range(self.kv_heads)
        ]
        return _read_jobs(self, jobs, pool, n)


class KVBlockFile(_NamelessFile):
    """Tokens [0, capacity) of every layer of one sequence as blocks of `block_tokens` tokens of
    `block_bytes` each (compressed: models/kv_coded_blocks.py), laid out [layers, blocks]: a layer's
    tokens [0, n) are one range, read in READ_PARTS parts side by side."""

    def __init__(self, folder: str, layers: int, block_tokens: int, block_bytes: int, capacity: int):
        self.layers, self.block_tokens, self.block_bytes = layers, block_tokens, block_bytes
        self.blocks = -(-capacity // block_tokens)
        super().__init__(folder, layers * self.blocks * block_bytes, capacity)

    def _block(self, token: int) -> int:
        if token % self.block_tokens:
            raise ValueError(f"token {token} does not start a block of {self.block_tokens}")
        return token // self.block_tokens

    def write_blocks(self, layer: int, start: int, data: np.ndarray) -> None:
        """Blocks of tokens from `start` (a block's first) of one layer: uint8 [blocks, block_bytes]."""
        first = self._block(start)
        if data.ndim != 2 or data.shape[1] != self.block_bytes or first + data.shape[0] > self.blocks:
            raise ValueError(f"blocks {data.shape} from token {start} do not fit the file's {self.capacity} tokens")
        try:
            at = (layer * self.blocks + first) * self.block_bytes
            self.bytes_written += write_all(self.fd, memoryview(np.ascontiguousarray(data)).cast("B"), at)
        except OSError as e:
            raise disk_error(KVTierError, self.where, e, said="KV on flash") from None

    def read_blocks(self, layer: int, start: int, n: int, out: np.ndarray, pool=None) -> int:
        """Tokens [start, n) of one layer (whole blocks) into the same blocks of `out` (uint8 [blocks >=
        n's, block_bytes], contiguous); the bytes read."""
        first, end = self._block(start), self._block(n)
        if out.shape[0] < end or out.shape[1] != self.block_bytes or not out.flags.c_contiguous:
            raise ValueError(f"a read buffer {out.shape} does not hold {end} blocks of {self.block_bytes} bytes")
        cuts = np.linspace(first, end, min(READ_PARTS, max(end - first, 1)) + 1).astype(int)
        base = layer * self.blocks * self.block_bytes
        jobs = [
            (memoryview(out[a:b]).cast("B"), base + a * self.block_bytes) for a, b in zip(cuts[:-1], cuts[1:]) if b > a
        ]
        return _read_jobs(self, jobs, pool, n)


def check_tier_folder(folder: str) -> None:
    """Refuse `folder` (KVTierError, one line) where no file could be made in it: it or a folder above
    it is a file, or its disk is read-only, or this user may not write there. Asked at load, so a plan
    with KV tiers is refused then, not at the first prompt long enough to reach flash."""
    blocker = file_in_the_way(os.path.join(folder, "kv.tier"))  # the folder itself counts
    cause = errno.ENOTDIR if blocker else None
    if cause is None:
        existing = os.path.abspath(folder)
        while not os.path.exists(existing):  # where makedirs would start
            existing = os.path.dirname(existing)
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            cause = errno.EROFS
        elif not os.access(existing, os.W_OK | os.X_OK):
            cause = errno.EACCES
    if cause is not None:
        raise disk_error(KVTierError, folder, OSError(cause, os.strerror(cause)), said="KV on flash")


def _reserved(folder: str, nbytes: int, capacity: int) -> tuple[int, int | None, str]:
    """A nameless file of `nbytes` reserved under `folder`: (descriptor, a descriptor of it that
    bypasses the page cache or None, folder). A failure names the tokens and bytes, and the cause as
    durable.write_failure says it (a full disk with what is free, a read-only one, a file in the way)."""
    said = f"KV on flash for {capacity} tokens ({fmt(nbytes)})"
    try:
        os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="kv-", suffix=".tier", dir=folder)
    except OSError as e:
        raise disk_error(KVTierError, folder, e, said=said) from None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        direct = open_direct(path) if nbytes >= BLOCK else None  # (its probe reads a block)
    except OSError as e:
        os.close(fd)
        raise disk_error(KVTierError, folder, e, said=said) from None
    finally:
        os.unlink(path)  # nameless from here: the kernel frees it when the process lets both descriptors go
    return fd, direct, folder


def _read_jobs(file: _NamelessFile, jobs: list[tuple[memoryview, int]], pool, n: int) -> int:
    """Each (view, offset) of `file` read whole, by `pool` side by side when given, past the page
    cache where the view, offset and length are aligned; the bytes read."""

    def one(view: memoryview, at: int) -> None:
        aligned = file.direct_fd is not None and (at | view.nbytes | _address(view)) % BLOCK == 0
        try:
            whole = read_all(file.direct_fd if aligned else file.fd, view, at)
        except OSError as e:
            raise KVTierError(f"KV on flash under {file.where}: cannot read it ({e.strerror})") from None
        if not whole:
            raise KVTierError(f"KV on flash under {file.where}: the file ends before token {n}")

    if pool is None:
        for view, at in jobs:
            one(view, at)
    else:
        for done in [pool.submit(one, view, at) for view, at in jobs]:
            done.result()
    return sum(view.nbytes for view, _ in jobs)


def _address(view: memoryview) -> int:
    """Where a writable view's bytes start."""
    return np.frombuffer(view, np.uint8).ctypes.data
