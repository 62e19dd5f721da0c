"""durable.py: the order of its calls (bytes fsynced before the rename, the folder after), what a
failure leaves (the old file, no temporary) and the one line it says."""

from __future__ import annotations

import errno
import os

import pytest

from mlx_flash import durable
from mlx_flash.errors import DiskError


class WriteError(DiskError):
    pass


class Recorder:
    """`os` as durable.py sees it, logging the calls that make a write durable by the path they act
    on; `fail` (call name -> errno) makes the first such call fail."""

    def __init__(self, fail: dict | None = None):
        self.paths, self.log, self.fail = {}, [], dict(fail or {})

    def __getattr__(self, name):
        return getattr(os, name)

    def _maybe_fail(self, name):
        if name in self.fail:
            code = self.fail.pop(name)
            raise OSError(code, os.strerror(code))

    def open(self, path, flags, mode=0o777, **kw):
        self._maybe_fail("open")
        fd = os.open(path, flags, mode, **kw)
        self.paths[fd] = os.path.abspath(path)
        return fd

    def write(self, fd, data):
        self._maybe_fail("write")
        self.log.append(("write", self.paths[fd]))
        return os.write(fd, data)

    def fsync(self, fd):
        self._maybe_fail("fsync")
        self.log.append(("fsync", self.paths[fd]))
        os.fsync(fd)

    def replace(self, a, b):
        self._maybe_fail("replace")
        self.log.append(("replace", os.path.abspath(a), os.path.abspath(b)))
        os.replace(a, b)


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    monkeypatch.setattr(durable, "os", r)
    return r


def test_write_durably_fsyncs_the_bytes_then_renames_then_fsyncs_the_folder(tmp_path, rec):
    path = str(tmp_path / "a.json")
    durable.write_durably(path, [b"one ", memoryview(b"two")], WriteError)
    assert open(path, "rb").read() == b"one two"
    tmp = f"{path}.tmp-{os.getpid()}"
    assert rec.log == [("write", tmp), ("write", tmp), ("fsync", tmp), ("replace", tmp, path), ("fsync", str(tmp_path))]
    assert os.listdir(tmp_path) == ["a.json"]


@pytest.mark.parametrize(
    "call, code, said",
    [
        ("write", errno.ENOSPC, "the disk is full ("),
        ("fsync", errno.EIO, "an I/O error"),
        ("replace", errno.EROFS, "the disk is read-only"),
        ("open", errno.EACCES, "no permission to write it"),
    ],
)
def test_a_failed_write_leaves_the_old_file_and_says_why_in_one_line(tmp_path, monkeypatch, call, code, said):
    path = str(tmp_path / "kept.bin")
    open(path, "wb").write(b"old")
    monkeypatch.setattr(durable, "os", Recorder({call: code}))
    with pytest.raises(WriteError) as e:
        durable.write_durably(path, [b"new bytes"], WriteError)
    assert str(e.value).startswith(f"{path}: {said}") and "\n" not in str(e.value)
    assert open(path, "rb").read() == b"old"
    assert os.listdir(tmp_path) == ["kept.bin"]  # no temporary left behind


def test_a_full_disk_names_the_bytes_needed_and_free(tmp_path, monkeypatch):
    monkeypatch.setattr(durable, "os", Recorder({"write": errno.ENOSPC}))
    with pytest.raises(WriteError, match=r": the disk is full \(needs 5\.0 MB, [0-9.]+ MB free\)$"):
        with durable.DurableFile(str(tmp_path / "big"), WriteError, needed=5_000_000) as f:
            f.write(b"x")


def test_a_file_where_a_folder_should_be_is_named(tmp_path):
    (tmp_path / "blocker").write_bytes(b"")
    path = str(tmp_path / "blocker" / "sub" / "f.json")
    with pytest.raises(WriteError, match=f"{tmp_path / 'blocker'} is a file, not a folder$"):
        durable.write_durably(path, [b"{}"], WriteError)


def test_an_error_inside_the_block_keeps_the_old_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    with pytest.raises(KeyError):
        with durable.DurableFile(str(path), WriteError) as f:
            f.write(b"half")
            raise KeyError("a bug in the caller")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_folder_file_writes_in_place_with_offsets_padding_and_positional_writes(tmp_path, rec):
    path = str(tmp_path / "data.bin")
    with durable.FolderFile(path, WriteError) as f:
        f.write(b"abc")
        f.pad_to(8)
        assert f.tell() == 8
        f.write(bytearray(b"z" * 4))
        f.write_at(b"XY", 1)
    assert open(path, "rb").read() == b"aXY" + bytes(5) + b"zzzz"
    assert rec.log[-1] == ("fsync", path)  # its own bytes fsynced; no rename (the folder's is)
    assert not any(entry[0] == "replace" for entry in rec.log)


def test_folder_file_is_removed_when_its_write_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(durable, "os", Recorder({"write": errno.ENOSPC}))
    with pytest.raises(WriteError, match="the disk is full"):
        durable.write_new(str(tmp_path / "x"), [b"1"], WriteError)
    assert os.listdir(tmp_path) == []


def test_reserve_says_a_full_disk_before_any_write(tmp_path, monkeypatch):
    def no_room(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    fake = Recorder()
    fake.posix_fallocate = no_room
    monkeypatch.setattr(durable, "os", fake)
    with pytest.raises(WriteError, match=r"the disk is full \(needs 7\.0 MB"):
        with durable.DurableFile(str(tmp_path / "big"), WriteError) as f:
            f.reserve(7_000_000)
    assert os.listdir(tmp_path) == []


def test_replace_folder_fsyncs_every_file_and_folder_before_the_rename_and_the_parent_after(tmp_path, rec):
    tmp, out = tmp_path / ".out.partial", tmp_path / "out"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a").write_bytes(b"a")
    (tmp / "sub" / "b").write_bytes(b"b")
    out.mkdir()
    (out / "old").write_bytes(b"old")
    durable.replace_folder(str(tmp), str(out), WriteError)
    synced = {entry[1] for entry in rec.log[: rec.log.index(next(e for e in rec.log if e[0] == "replace"))]}
    assert synced == {str(tmp / "a"), str(tmp / "sub" / "b"), str(tmp / "sub"), str(tmp)}
    assert rec.log[-1] == ("fsync", str(tmp_path))
    assert sorted(os.listdir(out)) == ["a", "sub"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_append_file_resumes_and_fsyncs_what_arrived_even_on_an_error(tmp_path, rec):
    path = str(tmp_path / "blob.incomplete")
    with pytest.raises(ConnectionError):
        with durable.AppendFile(path, WriteError, fresh=True) as f:
            f.write(b"first ")
            raise ConnectionError("dropped")
    assert rec.log[-1] == ("fsync", path)
    with durable.AppendFile(path, WriteError, fresh=False) as f:
        f.write(b"second")
        f.sync()
    assert open(path, "rb").read() == b"first second"
    with durable.AppendFile(path, WriteError, fresh=True) as f:
        f.write(b"anew")
    assert open(path, "rb").read() == b"anew"
    durable.move_durably(path, str(tmp_path / "blob"), WriteError)
    assert rec.log[-2:] == [("replace", path, str(tmp_path / "blob")), ("fsync", str(tmp_path))]


def test_copy_new_copies_in_chunks(tmp_path, rec, monkeypatch):
    monkeypatch.setattr(durable, "COPY_CHUNK", 4)
    (tmp_path / "src").write_bytes(b"0123456789")
    durable.copy_new(str(tmp_path / "src"), str(tmp_path / "dst"), WriteError)
    assert (tmp_path / "dst").read_bytes() == b"0123456789"
    assert [e[0] for e in rec.log] == ["write", "write", "write", "fsync"]


def test_truncate_durably_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": 1}\n{"id"')
    durable.truncate_durably(str(path), 10, WriteError)
    assert path.read_bytes() == b'{"id": 1}\n'
    with pytest.raises(WriteError, match="out-missing.jsonl: cannot write it"):  # (its folder is there)
        durable.truncate_durably(str(tmp_path / "out-missing.jsonl"), 0, WriteError)


def test_write_json_in_a_folder_or_durably(tmp_path):
    durable.write_json(str(tmp_path / "a.json"), {"é": 1}, WriteError)
    durable.write_json(str(tmp_path / "b.json"), [1], WriteError, indent=None, in_folder=True)
    assert (tmp_path / "a.json").read_text(encoding="utf-8") == '{\n "é": 1\n}'
    assert (tmp_path / "b.json").read_text() == "[1]"


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(WriteError, match=f"f.json: its folder {tmp_path / 'gone'} does not exist$"):
        durable.write_durably(str(tmp_path / "gone" / "f.json"), [b"{}"], WriteError)
