"""The converted stores in the cache (`<cache>/stores/`): what each was converted from, its size on
disk, the converter version that wrote it and its last use; removing one, and pruning the stores an
older converter wrote, the broken ones and the partial directories of conversions that died. A
folder there whose manifest is gone, unreadable or not a store's is a broken store: listed with its
size and why, counted, removable by name, and pruned (no load can open it as it is). A store that
a live engine or conversion holds (store/in_use.py) is refused with one line, never removed under it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass

from ..convert import CONVERTER_VERSION
from ..errors import ConfigError, StoreError
from ..store.atomic_dir import PARTIAL_NAME, process_alive
from ..store.in_use import conversion_lock_path, in_use_path, try_exclusive
from ..store.manifest import FORMAT_NAME, MANIFEST_NAME

LOCK_NAME = re.compile(r"^\.(.+)\.(lock|in-use)$")


@dataclass(frozen=True)
class CachedStore:
    name: str
    path: str
    source: str  # the file or folder it was converted from ("?" when not recorded)
    size: int  # bytes of its files
    converter_version: int | None  # None: written before stores recorded it
    last_used: float  # seconds since the epoch
    partial_pid: int = 0  # a conversion's unfinished folder: its writer's process
    broken: str = ""  # why no load can use it (no manifest, an unreadable one...); "" for a sound store

    @property
    def outdated(self) -> bool:
        return not self.partial_pid and not self.broken and (self.converter_version or 0) < CONVERTER_VERSION

    @property
    def dead_partial(self) -> bool:
        return bool(self.partial_pid) and not process_alive(self.partial_pid)


def stores_dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "stores")


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _read_manifest(path: str) -> tuple[dict, str]:
    """The manifest of the store folder `path` as JSON and ""; or {} and why no load can use it.
    Only what a listing needs: opening the store validates the rest."""
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError:
        return {}, f"no {MANIFEST_NAME}"
    except OSError as e:
        return {}, f"{MANIFEST_NAME} cannot be read ({e.strerror})"
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return {}, f"{MANIFEST_NAME} is not valid JSON"
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        return {}, f"{MANIFEST_NAME} is not a store manifest"
    return m, ""


def _describe(path: str, name: str) -> CachedStore:
    m, broken = _read_manifest(path)
    src = m.get("source")
    src = src if isinstance(src, dict) else {}
    source = "?" if broken else str(src.get("file") or src.get("dir") or "?")
    version = src.get("converter_version")
    version = version if isinstance(version, int) and not isinstance(version, bool) else None
    marks = [in_use_path(path), os.path.join(path, MANIFEST_NAME)]
    last = max((os.stat(mark).st_mtime for mark in marks if os.path.exists(mark)), default=0.0)
    return CachedStore(name, path, source, _size(path), version, last, broken=broken)


def list_stores(cache_dir: str) -> list[CachedStore]:
    """Every store in the cache, broken ones too, and every unfinished conversion's folder, by name."""
    folder = stores_dir(cache_dir)
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StoreError(f"{folder}: cannot list it ({e.strerror})") from None
    out = []
    for n in names:
        path = os.path.join(folder, n)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        m = PARTIAL_NAME.match(n)
        if m:
            out.append(
                CachedStore(
                    m.group(1),
                    path,
                    "(unfinished conversion)",
                    _size(path),
                    None,
                    os.stat(path).st_mtime,
                    int(m.group(2)),
                )
            )
        else:
            out.append(_describe(path, n))
    return out


def find(cache_dir: str, name: str) -> CachedStore:
    """The finished store called `name` (a broken one too), or the only sound one converted from a
    source called `name`."""
    stores = [s for s in list_stores(cache_dir) if not s.partial_pid]
    exact = [s for s in stores if s.name == name]
    if exact:
        return exact[0]
    by_source = [s for s in stores if not s.broken and name in (s.source, os.path.splitext(s.source)[0])]
    if len(by_source) == 1:
        return by_source[0]
    if by_source:
        raise ConfigError(f"{name!r} names {len(by_source)} stores: {', '.join(s.name for s in by_source)}")
    have = ", ".join(s.name for s in stores) or "none"
    raise ConfigError(f"no store {name!r} in {stores_dir(cache_dir)} (stores there: {have})")


CONVERTING = "a conversion is writing it; try again when it ends"
IN_USE = "a running engine holds it; close that engine first"


def held_by(store: CachedStore) -> str | None:
    """Why `store` cannot be removed now (a conversion or an engine holds it), or None. A look only,
    creating no lock file (a missing one is held by nobody); the answer can change the moment after,
    so remove() decides under the locks."""
    for path, why in ((conversion_lock_path(store.path), CONVERTING), (in_use_path(store.path), IN_USE)):
        if not os.path.exists(path):
            continue
        lock = try_exclusive(path)
        if lock is None:
            return why
        lock.close()
    return None


def remove(store: CachedStore) -> None:
    """Delete `store` and its lock files; refused while an engine or a conversion holds it."""
    conv = try_exclusive(conversion_lock_path(store.path))
    if conv is None:
        raise StoreError(f"{store.name}: {CONVERTING}")
    try:
        use = try_exclusive(in_use_path(store.path))
        if use is None:
            raise StoreError(f"{store.name}: {IN_USE}")
        try:
            try:
                shutil.rmtree(store.path)
            except OSError as e:
                raise StoreError(f"{store.path}: cannot remove it ({e.strerror})") from None
            for lock in (in_use_path(store.path), conversion_lock_path(store.path)):
                try:
                    os.unlink(lock)
                except OSError:
                    pass
        finally:
            use.close()
    finally:
        conv.close()


def prune(cache_dir: str, dry_run: bool = False) -> tuple[list[CachedStore], list[str]]:
    """Remove the stores an older converter wrote, the broken ones and the folders of conversions
    whose process is gone. Returns (removed, one line per store left and why); with dry_run, what
    it would remove and keep, touching nothing."""
    removed, kept = [], []
    for s in list_stores(cache_dir):
        if s.partial_pid:
            if s.dead_partial:
                if not dry_run:
                    shutil.rmtree(s.path, ignore_errors=True)
                removed.append(s)
            else:
                kept.append(f"{s.name}: being converted (process {s.partial_pid})")
        elif s.outdated or s.broken:
            if dry_run:
                why = held_by(s)
                if why:
                    kept.append(f"{s.name}: {why}")
                else:
                    removed.append(s)
                continue
            try:
                remove(s)
                removed.append(s)
            except StoreError as e:
                kept.append(str(e))
    if not dry_run:
        _remove_orphan_locks(stores_dir(cache_dir))
    return removed, kept


def _remove_orphan_locks(folder: str) -> None:
    """Lock files of stores that are gone (a conversion killed before it ended leaves its lock)."""
    try:
        names = set(os.listdir(folder))
    except OSError:
        return
    partial = {m.group(1) for p in names if (m := PARTIAL_NAME.match(p))}
    for n in names:
        m = LOCK_NAME.match(n)
        if not m or m.group(1) in names or m.group(1) in partial:
            continue
        held = try_exclusive(os.path.join(folder, n))
        if held is not None:  # nobody waits on it
            try:
                os.unlink(os.path.join(folder, n))
            except OSError:
                pass
            held.close()
