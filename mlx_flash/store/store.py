"""Open a store directory: validate its manifest completely, then hand out bytes as numpy arrays."""

from __future__ import annotations

import os

import numpy as np

from ..errors import ModelNotFoundError, StoreError
from ..host_memory import anonymous_buffer
from .bundles import NUMPY_DTYPES
from .in_use import hold
from .manifest import MANIFEST_NAME, Manifest
from .safetensors_io import tensor_layer
from ..config import default_cache_dir


# A buffer holds a file range at the address alignment the range has in the file (mod ALIGN), so a
# tensor lies equally aligned whichever range it was read with: a BLAS kernel may round differently
# at differently aligned addresses (torch's CPU float GEMV, measured: 8- against 16-byte aligned
# weights), and a tensor read whole-file, run by run or into a streamed layer's slot must give the
# same bits.
ALIGN = 64


def lead(offset: int) -> int:
    """Bytes a buffer keeps before a range read from file `offset` (ALIGN above)."""
    return offset % ALIGN


class Store:
    """A validated store. Tensors come back as numpy arrays over bytes read from disk."""

    def __init__(self, path: str, manifest: Manifest):
        self.path = path
        self.manifest = manifest
        self._held = hold(path)  # while this Store lives, the store cannot be removed (in_use.py)
        self._by_layer: dict[int | None, list] = {}  # layer (None: of no layer) -> its (name, TensorEntry)
        for name, t in manifest.tensors.items():
            self._by_layer.setdefault(tensor_layer(name), []).append((name, t))

    @property
    def config(self) -> dict:
        return self.manifest.config

    def file_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_resident(self, skip_layers=(), alloc=None) -> dict[str, tuple[np.ndarray, str]]:
        """Every resident tensor but those of `skip_layers` (streamed layers, read into their own
        buffers): name -> (numpy array, storage dtype name), views of one buffer per file region
        read (the whole file when nothing is skipped; else each kept layer's region and each tensor
        of no layer). `alloc(nbytes)` gives the buffers (a backend's memory, which its kernels read in
        place; default page-aligned anonymous memory)."""
        alloc = alloc or anonymous_buffer
        if not skip_layers:
            blobs = {}
            for f in {t.file for t in self.manifest.tensors.values()}:
                blobs[f] = self._read(f, 0, os.path.getsize(self.file_path(f)), alloc)
            return {name: tensor_view(blobs[t.file], 0, t) for name, t in self.manifest.tensors.items()}
        regions, out = self.layer_regions(), {}
        if regions is None:
            raise StoreError(
                f"{self.path}: its resident file does not keep each layer's tensors together "
                "(converted by an older version): convert the model again to stream layers"
            )
        for run in self._runs(self._by_layer.get(None, [])):
            first, last = run[0][1], run[-1][1]
            blob = self._read(first.file, first.offset, last.offset + last.nbytes - first.offset, alloc)
            for name, t in run:  # one buffer per run: a matrix's parts (codes, scales, biases) lie in one memory
                out[name] = tensor_view(blob, first.offset - lead(first.offset), t)
        for name, t in self.manifest.tensors.items():
            layer = tensor_layer(name)
            if layer is None:
                continue
            elif layer not in skip_layers and name not in out:
                file, off, n = regions[layer]
                blob = self._read(file, off, n, alloc)
                for other, u in self.layer_tensors(layer):
                    out[other] = tensor_view(blob, off - lead(off), u)
        return out

    @staticmethod
    def _runs(named) -> list[list]:
        """(name, TensorEntry) pairs grouped into runs that lie back to back in one file, in file order."""
        runs = []
        for name, t in sorted(named, key=lambda nt: (nt[1].file, nt[1].offset)):
            last = runs[-1][-1][1] if runs else None
            if last is not None and last.file == t.file and last.offset + last.nbytes == t.offset:
                runs[-1].append((name, t))
            else:
                runs.append([(name, t)])
        return runs

    def layer_tensors(self, layer: int) -> list:
        """(name, TensorEntry) of the resident tensors of one layer."""
        return list(self._by_layer.get(layer, ()))

    def layer_regions(self) -> dict[int, tuple[str, int, int]] | None:
        """layer -> (file, offset, bytes): each layer's resident tensors as one contiguous range of
        one file holding nothing else, or None when the file does not keep layers together."""
        spans: dict[int, list] = {}
        for name, t in self.manifest.tensors.items():
            layer = tensor_layer(name)
            if layer is not None:
                spans.setdefault(layer, []).append(t)
        out = {}
        for layer, ts in spans.items():
            if len({t.file for t in ts}) != 1:
                return None
            start, end = min(t.offset for t in ts), max(t.offset + t.nbytes for t in ts)
            if end - start != sum(t.nbytes for t in ts):  # something else lies inside the span
                return None
            out[layer] = (ts[0].file, start, end - start)
        return out

    def read_bytes(self, file: str, offset: int, nbytes: int) -> np.ndarray:
        """`nbytes` bytes of one of the store's files from `offset` (uint8)."""
        return self._read(file, offset, nbytes)[lead(offset) :]

    def _read(self, file: str, offset: int, nbytes: int, alloc=None) -> np.ndarray:
        """A buffer holding `nbytes` of `file` from `offset`, after lead(offset) bytes it leaves unread
        (with a buffer aligned to ALIGN, each byte lies at its file offset's alignment)."""
        before = lead(offset)
        buf = (alloc or anonymous_buffer)(before + nbytes)
        with open(self.file_path(file), "rb") as fh:
            fh.seek(offset)
            if fh.readinto(memoryview(buf)[before:]) != nbytes:
                raise StoreError(f"{self.path}: {file} is shorter than its manifest says")
        return buf


def tensor_view(blob: np.ndarray, blob_offset: int, t) -> tuple[np.ndarray, str]:
    """(a view of tensor entry `t` inside `blob`, which holds its file's bytes from `blob_offset`, dtype)."""
    raw = blob[t.offset - blob_offset : t.offset - blob_offset + t.nbytes]
    return raw.view(NUMPY_DTYPES[t.dtype]).reshape(t.shape), t.dtype


def is_store(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def open_store(
    path: str, verify_checksums: bool = False, progress: bool = False, cache_dir: str | None = None
) -> Store:
    """Validate the whole manifest (its schema, files, sizes, offsets in range, no overlaps) and
    every file's sha256: hashed once and stamped in `cache_dir` (default: the engine's), all of them
    again when `verify_checksums` (store/verified.py), with a progress bar when `progress`."""
    if not os.path.exists(path):
        raise ModelNotFoundError(f"{path}: no such store directory")
    mpath = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(mpath):
        raise StoreError(
            f"{path}: not a store (no {MANIFEST_NAME}; convert the model with python -m mlx_flash.convert)"
        )
    with open(mpath, encoding="utf-8", errors="replace") as fh:
        manifest = Manifest.from_json(fh.read(), mpath)
    if cache_dir is None:
        cache_dir = default_cache_dir()
    manifest.validate(path, verify_checksums=verify_checksums, progress=progress, cache_dir=cache_dir)
    return Store(os.path.abspath(path), manifest)
