"""tools/dependencies.py, what `make chat` installs: pyproject's dependencies and its build's
requirements exactly, by tomllib and by the plain reading Python 3.10 takes, less a cmake that the one
on PATH already meets."""

import builtins
import os
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import dependencies  # noqa: E402


@pytest.mark.parametrize("which", [dependencies.RUNTIME, dependencies.BUILD], ids=["dependencies", "build"])
def test_both_readings_give_pyprojects_arrays(which, monkeypatch):
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    table, key, _ = which
    want = tomllib.loads(text)[table][key]
    assert any("[" in r for r in want)  # (an extra's brackets inside the array: the plain reading's trap)
    assert dependencies.requirements(text, which) == want
    real_import = builtins.__import__

    def no_tomllib(name, *a, **kw):  # Python 3.10
        if name == "tomllib":
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tomllib)
    assert dependencies.requirements(text, which) == want


def test_main_prints_them_and_drops_cmake_only_where_path_has_one_recent_enough(monkeypatch, capsys):
    path = os.path.join(ROOT, "pyproject.toml")
    with open(path) as f:
        text = f.read()
    assert dependencies.main([path]) == 0
    assert capsys.readouterr().out.splitlines() == tomllib.loads(text)["project"]["dependencies"]
    build = tomllib.loads(text)["build-system"]["requires"]
    assert "cmake>=3.24" in build
    for present, kept in [(None, True), ((3, 22), True), ((3, 24), False), ((4, 1), False)]:
        monkeypatch.setattr(dependencies, "cmake_on_path", lambda: present)
        assert dependencies.main(["--build", path]) == 0
        assert capsys.readouterr().out.splitlines() == [r for r in build if kept or not r.startswith("cmake")]


def test_cmake_on_path_reads_the_version_or_says_none(monkeypatch, tmp_path):
    fake = tmp_path / "cmake"
    fake.write_text("#!/bin/sh\necho 'cmake version 3.25.1'\necho\necho 'CMake suite maintained'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert dependencies.cmake_on_path() == (3, 25)
    fake.write_text("#!/bin/sh\necho 'something else'\n")
    assert dependencies.cmake_on_path() is None
    monkeypatch.setenv("PATH", str(tmp_path / "absent"))
    assert dependencies.cmake_on_path() is None


@pytest.mark.parametrize("flag", [[], ["--build"]])
def test_a_file_without_them_is_one_line(flag, tmp_path, capsys):
    (tmp_path / "p.toml").write_text("[project]\nname = 'x'\n")
    assert dependencies.main([*flag, str(tmp_path / "p.toml")]) == 2
    what = "build requirements" if flag else "dependencies"
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'p.toml'}: cannot read the {what}")
