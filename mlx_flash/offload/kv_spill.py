"""KV cache on flash between its turns (FlexGen §4.1's disk tier for the cache): the sequences of a
block's last `policy.kv_on_flash` micro-batches keep their keys and values in a file each, and only
the layer a micro-batch is computing is in memory.

    <folder>/seq-<n>.kv   one sequence's KV, every layer: [layers, 2, capacity, Hkv, hd] float32,
                          token-major, so a step's new token of a row is one contiguous write and a
                          row's held tokens one contiguous read

A layer's turn (SpilledKV.update) reads each row's held tokens (read ahead by `prefetch` while the
micro-batch before it computes), writes the step's new tokens at each row's own length, and hands
the graph the keys and values right-padded to the longest row, with the same mask and positions as
batching/batch_cache.BlockKV gives: the attention sees the same numbers, so the tokens are the same.
Written pages go to the page cache and are flushed by the kernel behind the compute (the writer).

The folder is private to the run (mode 0700, under the cache directory or the system's temporary
one) and removed with everything in it when the run ends. It holds a lock for its run's lifetime, so
a run killed before its end leaves a folder whose lock is free: the next run's SpillFolder removes
it (reap_orphans). Files are float32 whatever the activation
dtype, so a spilled value reads back bit for bit. This module moves numpy arrays and bytes; backend
arrays are made in SpilledKV.update only.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..durable import disk_error
from ..errors import DiskError
from ..batching.batch_cache import padded_mask
from ..models.cache import LayerKV
from ..store.positional_io import read_all, write_all

_F32 = 4


class SpillError(DiskError):
    """The spill folder could not be made or written (full disk, permissions)."""


PREFIX, LOCK = "kv-spill-", ".lock"


def reap_orphans(parent: str) -> list[str]:
    """Remove the spill folders under `parent` whose run has ended without removing them (killed):
    their lock is free. Folders of live runs, and anything without a lock, are left. Returns the
    removed paths."""
    removed = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not name.startswith(PREFIX) or not os.path.isfile(os.path.join(path, LOCK)):
            continue
        try:
            with open(os.path.join(path, LOCK)) as fh:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(path, ignore_errors=True)  # (still locked: no run can be inside it)
                removed.append(path)
        except (BlockingIOError, FileNotFoundError, PermissionError):
            continue  # a live run's, one being removed, or another user's
    return removed


class SpillFolder:
    """Where one run's spilled KV lives; a single reader thread reads ahead."""

    def __init__(self, parent: str | None = None):
        try:
            if parent:
                os.makedirs(parent, exist_ok=True)
            self.path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)  # mode 0700
            # locked under another name, then renamed: a folder shows its lock only once the lock is
            # held, so another run's reap_orphans never finds this one's free in between and removes it
            self._lock = open(os.path.join(self.path, LOCK + ".new"), "w")  # (not durable: a lock, no data)
            fcntl.flock(self._lock, fcntl.LOCK_EX)  # held until close() or the process ends
            os.rename(os.path.join(self.path, LOCK + ".new"), os.path.join(self.path, LOCK))
        except OSError as e:
            raise disk_error(SpillError, parent or tempfile.gettempdir(), e, said="KV spill folder") from None
        reap_orphans(os.path.dirname(self.path))
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="kv-spill")
        self._files: list[SpillFile] = []

    def file(self, layers: int, kv_heads: int, head_dim: int, capacity: int) -> "SpillFile":
        f = SpillFile(os.path.join(self.path, f"seq-{len(self._files):06d}.kv"), layers, kv_heads, head_dim, capacity)
        self._files.append(f)
        return f

    def close(self) -> None:
        self.reader.shutdown(wait=True)
        for f in self._files:
            f.close()
        self._files = []
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SpillFile:
    """One sequence's keys and values, every layer, at fixed offsets (positional reads and writes)."""

    def __init__(self, path: str, layers: int, kv_heads: int, head_dim: int, capacity: int):
        self.path, self.capacity = path, capacity
        self.token = kv_heads * head_dim  # floats of one token's keys (or values) in one layer
        self.row_shape = (kv_heads, head_dim)
        nbytes = layers * 2 * capacity * self.token * _F32
        try:  # (not durable: the run's own, removed when it ends; nothing reads it after a crash)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(self.fd, nbytes)
        except OSError as e:
            raise disk_error(SpillError, path, e, nbytes) from None

    def _offset(self, layer: int, which: int, position: int) -> int:
        return ((layer * 2 + which) * self.capacity + position) * self.token * _F32

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Tokens [start, start + T) of one layer: k, v float32 [T, Hkv, hd]."""
        if start + k.shape[0] > self.capacity:
            raise ValueError(f"{start + k.shape[0]} tokens exceed the spill file's {self.capacity}")
        for which, a in ((0, k), (1, v)):
            data = memoryview(np.ascontiguousarray(a, np.float32)).cast("B")
            try:
                write_all(self.fd, data, self._offset(layer, which, start))
            except OSError as e:
                raise disk_error(SpillError, self.path, e, data.nbytes) from None

    def read_into(self, layer: int, n: int, k_out: np.ndarray, v_out: np.ndarray) -> None:
        """The first n tokens of one layer into k_out, v_out (float32 [n, Hkv, hd], contiguous)."""
        for which, out in ((0, k_out), (1, v_out)):
            if not read_all(self.fd, memoryview(out).cast("B"), self._offset(layer, which, 0)):
                raise SpillError(f"{self.path}: ends before token {n} of layer {layer}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SpilledKV(LayerKV):
    """One layer of some sequences whose KV is on flash (rows: their SpillFiles, at their lengths)."""

    holds = "the sequence's spill file holds"

    def __init__(self, folder: SpillFolder, files: list[SpillFile], layer: int, lengths):
        if not files:
            raise ValueError("a batch needs at least one sequence")
        self.folder, self.files, self.layer = folder, list(files), layer
        self.lengths = np.asarray(lengths, np.int64).copy()
        self.capacity = max(f.capacity for f in files)  # the longest row's room (each row checks its own)
        self._ahead: Future | None = None

    @property
    def offset(self) -> int:
        return int(self.lengths.max())

    def positions(self):
        return self.lengths.copy() if len(self.files) > 1 else int(self.lengths[0])

    def _read(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row's held tokens, right-padded with zeros: float32 [B, S, Hkv, hd] each."""
        B, S = len(self.files), int(self.lengths.max())
        keys = np.zeros((B, S) + self.files[0].row_shape, np.float32)
        values = np.zeros_like(keys)
        for b, (f, n) in enumerate(zip(self.files, self.lengths)):
            if n:
                f.read_into(self.layer, int(n), keys[b, :n], values[b, :n])
        return keys, values

    def prefetch(self) -> None:
        if self._ahead is None:
            self._ahead = self.folder.reader.submit(self._read)

    def update(self, ops, k, v):
        B, _, T, _ = k.shape
        L = self.lengths
        for f, n in zip(self.files, L):
            if int(n) + T > f.capacity:
                raise ValueError(f"{int(n) + T} tokens exceed the spill file's {f.capacity}")
        held_k, held_v = self._ahead.result() if self._ahead is not None else self._read()
        self._ahead = None
        new_k, new_v = np.asarray(ops.to_numpy(k), np.float32), np.asarray(ops.to_numpy(v), np.float32)
        self.lengths = L + T
        S = int(self.lengths.max())
        keys = np.zeros((B, k.shape[1], S, k.shape[3]), np.float32)  # what the graph attends over
        values = np.zeros_like(keys)
        for b, (f, n) in enumerate(zip(self.files, L)):
            n = int(n)
            f.write(self.layer, n, new_k[b].transpose(1, 0, 2), new_v[b].transpose(1, 0, 2))
            keys[b, :, :n], values[b, :, :n] = held_k[b, :n].transpose(1, 0, 2), held_v[b, :n].transpose(1, 0, 2)
            keys[b, :, n : n + T], values[b, :, n : n + T] = new_k[b], new_v[b]
        return ops.array(keys), ops.array(values)

    def mask(self, ops, T: int):
        if len(self.files) == 1:
            return "causal" if T > 1 else None
        return padded_mask(ops, self.lengths, T)

    def trim(self, n: int) -> None:
        self._check_trim(n)
        self.lengths = self.lengths - n

    def keep(self, ops, idx: list[int]) -> None:
        """Only rows idx stay (in that order); their files stay as they are."""
        self.files = [self.files[i] for i in idx]
        self.capacity = max(f.capacity for f in self.files)
        self.lengths = self.lengths[idx]
        self._ahead = None

    def state(self, ops):
        keys, values = self._read()
        if len(self.files) > 1:
            raise NotImplementedError("rows of different lengths: read each row's file")
        return keys.transpose(0, 2, 1, 3).copy(), values.transpose(0, 2, 1, 3).copy()


def spilled_rows(rows: list[SpilledKV]) -> SpilledKV:
    """One layer of a micro-batch from its sequences' single-row spilled caches (nothing copied)."""
    return SpilledKV(rows[0].folder, [r.files[0] for r in rows], rows[0].layer, [int(r.lengths[0]) for r in rows])
