"""store/atomic_dir.py: a folder replaced whole. A writer that died between its two renames (the old
output moved aside, the new not yet in place) leaves no output; the next writer in the folder puts
the new one in place (whole: it was fsynced before the old moved), or the old one back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlx_flash.store.atomic_dir import atomic_dir, remove_dead_partials


@pytest.fixture(scope="module")
def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def folder(path, **files):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)


@pytest.mark.parametrize("new_left", [True, False])
def test_a_writer_dead_between_its_renames_leaves_the_new_output_or_the_old(tmp_path, dead_pid, new_left):
    if new_left:
        folder(tmp_path / f".store.partial-{dead_pid}", manifest="new")
    folder(tmp_path / f".store.partial-{dead_pid}.old", manifest="old")
    folder(tmp_path / f".other.partial-{dead_pid}", manifest="half")  # an ordinary dead partial
    removed = remove_dead_partials(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["store"]
    assert (tmp_path / "store" / "manifest").read_text() == ("new" if new_left else "old")
    assert f".other.partial-{dead_pid}" in removed


def test_an_output_in_place_is_kept_and_the_dead_writers_folders_go(tmp_path, dead_pid):
    folder(tmp_path / "store", manifest="new")
    folder(tmp_path / f".store.partial-{dead_pid}.old", manifest="old")  # died before removing the old
    remove_dead_partials(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["store"] and (tmp_path / "store" / "manifest").read_text() == "new"


def test_atomic_dir_replaces_an_output_whole(tmp_path):
    out = tmp_path / "store"
    folder(out, manifest="old", extra="only in the old")
    with atomic_dir(str(out), progress=False) as tmp:
        with open(os.path.join(tmp, "manifest"), "w") as fh:
            fh.write("new")
        assert sorted(os.listdir(out)) == ["extra", "manifest"]  # the old one is whole until the end
    assert sorted(os.listdir(out)) == ["manifest"] and (out / "manifest").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["store"]  # no partial, no lock left
