"""Open a store directory: validate its manifest completely, then hand out bytes as numpy arrays."""

from __future__ import annotations

import os

import numpy as np

from ..errors import ModelNotFoundError, StoreError
from .bundles import NUMPY_DTYPES
from .manifest import MANIFEST_NAME, Manifest


class Store:
    """A validated store. Tensors come back as numpy arrays over bytes read from disk."""

    def __init__(self, path: str, manifest: Manifest):
        self.path = path
        self.manifest = manifest

    @property
    def config(self) -> dict:
        return self.manifest.config

    def file_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_resident(self) -> dict[str, tuple[np.ndarray, str]]:
        """Every resident tensor: name -> (numpy array, storage dtype name). One read per file."""
        blobs, out = {}, {}
        for name, t in self.manifest.tensors.items():
            if t.file not in blobs:
                blobs[t.file] = np.fromfile(self.file_path(t.file), dtype=np.uint8)
            raw = blobs[t.file][t.offset:t.offset + t.nbytes]
            out[name] = (raw.view(NUMPY_DTYPES[t.dtype]).reshape(t.shape), t.dtype)
        return out


def is_store(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def open_store(path: str, verify_checksums: bool = False, progress: bool = False) -> Store:
    """Validate the whole manifest (files, sizes, offsets in range, no overlaps; sha256 on request,
    with a progress bar when `progress`)."""
    if not os.path.exists(path):
        raise ModelNotFoundError(f"{path}: no such store directory")
    mpath = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(mpath):
        raise StoreError(f"{path}: not a store (no {MANIFEST_NAME}; convert the model with python -m mlx_flash.convert)")
    with open(mpath, encoding="utf-8", errors="replace") as fh:
        manifest = Manifest.from_json(fh.read(), mpath)
    manifest.validate(path, verify_checksums=verify_checksums, progress=progress)
    return Store(os.path.abspath(path), manifest)
