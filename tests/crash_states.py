"""The states a power loss can leave, at every point of an operation's writes (as SQLite's crash tests
build them): every os.open, os.write, os.pwrite, os.ftruncate, os.posix_fallocate, os.fsync,
os.replace, os.rename, os.mkdir, os.unlink and os.rmdir that mlx_flash code makes under a folder
(directly, or through os.makedirs, shutil.rmtree, tempfile) is traced onto a model of that folder:
inodes with their contents, folders with their entries. After each call, the state a power loss
would leave drops every write that was not fsynced. Two models of what that means for names:

- "fsync": a file holds what it held at its last fsync (nothing, if it was never fsynced since it
  was made); a folder holds the entries it held at its last fsync: a file made, renamed or removed
  there and not followed by an fsync of the folder is as it was (what was there before the
  operation counts as synced);
- "journal": file contents the same, but every name made, renamed or removed is kept at once and in
  order (a file system that journals its metadata and not the data: ext4's data=writeback, where a
  rename can reach the disk before the data it names).

`trace(root, operation)` runs the operation once and returns, per model, the distinct states (each a
dict of relative path -> bytes, or None for a folder) with the first point each appears at;
`materialize(state, folder)` writes one out. The trace checks itself: at the end the model's
unsynced view must be what is on disk, or a write it does not see (builtin open, a call it does not
trace) would make its states wrong, and it says so.
"""

from __future__ import annotations

import os

from fault_injection import package_frame

_TRACED = (
    "open",
    "close",
    "write",
    "pwrite",
    "ftruncate",
    "posix_fallocate",
    "fsync",
    "replace",
    "rename",
    "mkdir",
    "unlink",
    "rmdir",
)


class Node:
    """A file (data) or a folder (entries), each also as of its last fsync."""

    def __init__(self, is_dir: bool, data: bytes = b""):
        self.is_dir = is_dir
        self.data, self.synced = bytearray(data), bytes(data)
        self.entries: dict[str, Node] = {}
        self.synced_entries: dict[str, Node] = {}

    def sync(self) -> None:
        if self.is_dir:
            self.synced_entries = dict(self.entries)
        else:
            self.synced = bytes(self.data)


def _load(path: str) -> Node:
    """The folder as it is on disk, all of it synced (what was there before the operation)."""
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            return Node(False, f.read())
    node = Node(True)
    for name in sorted(os.listdir(path)):
        node.entries[name] = _load(os.path.join(path, name))
    node.sync()
    return node


MODELS = ("fsync", "journal")


def _view(node: Node, model: str | None, prefix: str = "") -> dict:
    """relative path -> bytes (a file) or None (a folder): after a power loss under `model`, or as
    the running system sees it (None)."""
    out = {}
    for name, child in sorted((node.synced_entries if model == "fsync" else node.entries).items()):
        path = prefix + name
        if child.is_dir:
            out[path] = None
            out.update(_view(child, model, path + "/"))
        else:
            out[path] = child.synced if model else bytes(child.data)
    return out


class Tracer:
    """While entered, the traced os calls of mlx_flash code under `root` update the model (after the
    real call succeeded); `states` collects each distinct power-loss state."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.model = _load(self.root)
        self.fds: dict[int, list] = {}  # fd -> [node, position, append]
        self.calls = 0
        # per model: state (sorted items) -> the first point it appears at
        self.states: dict[str, dict[tuple, int]] = {m: {} for m in MODELS}
        self._saved = []
        self._note()

    def __enter__(self) -> Tracer:
        for name in _TRACED:
            real = getattr(os, name)
            self._saved.append((name, real))
            setattr(os, name, self._wrap(name, real))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in reversed(self._saved):
            setattr(os, name, real)
        self._saved.clear()

    def _wrap(self, name, real):
        model = getattr(self, "_" + name)

        def traced(*args, **kw):
            result = real(*args, **kw)
            if package_frame(1) is not None:
                model(result, *args, **kw)
                self.calls += 1
                self._note()
            return result

        return traced

    def _note(self) -> None:
        for m in MODELS:
            self.states[m].setdefault(tuple(_view(self.model, m).items()), self.calls)

    def live(self) -> dict:
        return _view(self.model, None)

    # ---- paths ----------------------------------------------------------------------------------
    def _at(self, path, dir_fd=None) -> tuple[Node, str] | None:
        """(folder node, name) of `path`, None when it is outside the root (or its folder unknown)."""
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            base = self.fds.get(dir_fd)
            if base is None:
                return None
            node, parts = base[0], path.split("/")
        else:
            full = os.path.abspath(path)
            if not full.startswith(self.root + os.sep):
                return None
            node, parts = self.model, full[len(self.root) + 1 :].split("/")
        for part in parts[:-1]:
            node = node.entries.get(part) if node is not None and node.is_dir else None
        return (node, parts[-1]) if node is not None and node.is_dir else None

    def _node(self, path, dir_fd=None) -> Node | None:
        if dir_fd is None and os.path.abspath(os.fsdecode(path)) == self.root:
            return self.model
        at = self._at(path, dir_fd)
        return at[0].entries.get(at[1]) if at else None

    # ---- the calls, after they succeeded ----------------------------------------------------------
    def _open(self, fd, path, flags, mode=0o777, *, dir_fd=None):
        node = self._node(path, dir_fd)
        if node is None and flags & os.O_CREAT:
            at = self._at(path, dir_fd)
            if at is not None:
                node = at[0].entries[at[1]] = Node(False)
        if node is None:
            return
        if flags & os.O_TRUNC and not node.is_dir:
            del node.data[:]
        self.fds[fd] = [node, 0, bool(flags & os.O_APPEND)]

    def _close(self, result, fd):
        self.fds.pop(fd, None)

    def _put(self, node: Node, at: int, data) -> None:
        data = bytes(memoryview(data).cast("B"))
        if len(node.data) < at:
            node.data.extend(bytes(at - len(node.data)))
        node.data[at : at + len(data)] = data

    def _write(self, n, fd, data):
        f = self.fds.get(fd)
        if f is None:
            return
        at = len(f[0].data) if f[2] else f[1]
        self._put(f[0], at, memoryview(data).cast("B")[:n])
        f[1] = at + n

    def _pwrite(self, n, fd, data, offset):
        if fd in self.fds:
            self._put(self.fds[fd][0], offset, memoryview(data).cast("B")[:n])

    def _ftruncate(self, result, fd, length):
        if fd in self.fds:
            node = self.fds[fd][0]
            node.data = (node.data + bytearray(max(0, length - len(node.data))))[:length]

    def _posix_fallocate(self, result, fd, offset, length):
        if fd in self.fds and len(self.fds[fd][0].data) < offset + length:
            self._ftruncate(None, fd, offset + length)

    def _fsync(self, result, fd):
        if fd in self.fds:
            self.fds[fd][0].sync()

    def _replace(self, result, src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        a, b = self._at(src, src_dir_fd), self._at(dst, dst_dir_fd)
        node = a[0].entries.pop(a[1], None) if a else None
        if b is not None and node is not None:
            b[0].entries[b[1]] = node

    _rename = _replace

    def _mkdir(self, result, path, mode=0o777, *, dir_fd=None):
        at = self._at(path, dir_fd)
        if at is not None:
            at[0].entries[at[1]] = Node(True)

    def _unlink(self, result, path, *, dir_fd=None):
        at = self._at(path, dir_fd)
        if at is not None:
            at[0].entries.pop(at[1], None)

    _rmdir = _unlink


def _disk(root: str) -> dict:
    return _view(_load(root), None)


def trace(root: str, operation) -> tuple[dict[str, list[tuple[int, dict]]], int]:
    """Run `operation()` traced under `root`: (per model, [(first point, state)] of every distinct
    power-loss state in order, the state once it returned last; the number of points).
    AssertionError when the model's live view at the end is not what is on disk."""
    with Tracer(root) as t:
        operation()
    live, disk = t.live(), _disk(root)
    if live != disk:
        differ = sorted(p for p in live.keys() | disk.keys() if live.get(p, 0) != disk.get(p, 0))
        raise AssertionError(
            f"the crash model of {root} is not what is on disk after the operation at {differ[:5]}: "
            "written by a call it does not trace (builtin open, another os call)"
        )
    final = {m: dict(_view(t.model, m)) for m in MODELS}
    return {m: sorted((k, dict(s)) for s, k in t.states[m].items()) + [(t.calls, final[m])] for m in MODELS}, t.calls


def materialize(state: dict, folder: str) -> str:
    """Write `state` under `folder` (made); returns it."""
    os.makedirs(folder)
    for path, data in sorted(state.items()):
        full = os.path.join(folder, path)
        if data is None:
            os.makedirs(full, exist_ok=True)
        else:
            with open(full, "wb") as f:
                f.write(data)
    return folder


def describe(state: dict) -> str:
    """One line per entry: path and size (a state in a failure message)."""
    return "; ".join(f"{p}/" if d is None else f"{p} ({len(d)} bytes)" for p, d in sorted(state.items())) or "empty"
