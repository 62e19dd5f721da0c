"""tools/dependencies.py, what `make chat` installs beside the package's own build: pyproject's
dependencies exactly, by tomllib and by the plain reading Python 3.10 takes."""

import builtins
import os
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import dependencies  # noqa: E402


def test_both_readings_give_pyprojects_dependencies(monkeypatch, capsys):
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    want = tomllib.loads(text)["project"]["dependencies"]
    assert dependencies.dependencies(text) == want
    real_import = builtins.__import__

    def no_tomllib(name, *a, **kw):  # Python 3.10
        if name == "tomllib":
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tomllib)
    assert dependencies.dependencies(text) == want
    monkeypatch.undo()
    assert dependencies.main([os.path.join(ROOT, "pyproject.toml")]) == 0
    assert capsys.readouterr().out.splitlines() == want


def test_a_file_without_them_is_one_line(tmp_path, capsys):
    (tmp_path / "p.toml").write_text("[project]\nname = 'x'\n")
    assert dependencies.main([str(tmp_path / "p.toml")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'p.toml'}: cannot read the dependencies")
