"""Corruption is detected, never computed on: every store file is hashed whole (sha256, against the
manifest) before its first use, and the result stamped with the file's identity, so later opens
hash again only a file that changed.

    <cache_dir>/verified/<16 hex digits of the store's real path>.json
        {"<file name>": [size, mtime_ns, ctime_ns, inode, device, sha256], ...}

A file whose stamp does not match (a new store, a file written, replaced or touched since: any
write moves ctime, which no user can set back) is hashed again, with a progress bar for large
ones; a hash that differs from the manifest's refuses the store with one line naming the file.
Why whole files and not a hash per read unit: the per-token cost is zero in every mode (dense,
sparse rows, experts), where a hash per bundle or expert would be paid on every read; the price is
one pass over a store after conversion or a change (0.2 s for the default model, 12 s for a 3.4 GB
store).

Stamps are only a cache: one that cannot be read is ignored, one that cannot be written (a
read-only cache) means the next open hashes again.
"""

from __future__ import annotations

import hashlib
import json
import os

from ..durable import write_json
from ..errors import StoreError
from .atomic_dir import OutputError
from ..progress import byte_bar

STAMPS = "verified"


def identity(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def stamp_file(cache_dir: str, store_dir: str) -> str:
    key = hashlib.sha256(os.path.realpath(store_dir).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, STAMPS, f"{key}.json")


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            d = json.load(fh)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def _save(path: str, stamps: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, stamps, OutputError, indent=None)
    except (OSError, OutputError):
        pass  # a cache: the next open hashes again (see the module's docstring)


def sha256_file(path: str, bar=None, chunk: int = 1 << 22) -> str:
    """The file's sha256; `bar` (a tqdm bar), if given, advances by the bytes hashed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)
            if bar is not None:
                bar.update(len(b))


def verify_files(
    store_dir: str, files: dict[str, dict], cache_dir: str | None, force: bool = False, progress: bool = False
) -> int:
    """Hash every listed file whose stamp does not match (all of them when `force` or without a
    cache directory) and compare with the manifest's sha256; returns the bytes hashed."""

    path = stamp_file(cache_dir, store_dir) if cache_dir else None
    stamps = _load(path) if path and not force else {}
    todo = []
    for name, info in files.items():
        ident = identity(os.path.join(store_dir, name))
        if stamps.get(name) != ident + [info["sha256"]]:
            todo.append((name, ident))
    hashed = sum(ident[0] for _, ident in todo)
    with byte_bar(hashed, "verifying checksums", progress and hashed > (64 << 20)) as bar:
        for name, ident in todo:
            fpath = os.path.join(store_dir, name)
            try:
                got = sha256_file(fpath, bar)
            except OSError as e:
                raise StoreError(f"{fpath}: cannot read it ({e.strerror})") from None
            if got != files[name]["sha256"]:
                raise StoreError(f"{fpath}: sha256 mismatch (the file is corrupt or was modified since conversion)")
            stamps[name] = ident + [got]
    if path and todo:
        _save(path, {n: stamps[n] for n in files if n in stamps})
    return hashed
