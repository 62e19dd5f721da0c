"""The import's cost, measured in a child once per machine and kept in the cache."""

import json
import sys

import pytest

from mlx_flash.memory.import_cost import FILE, ImportKilled, measured_import_cost

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measured through /proc")
MB = 1 << 20


def _module(tmp_path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))


def test_a_module_holding_memory_costs_it_and_the_number_is_kept(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "holds_64mb", "import numpy\nBLOCK = numpy.ones(64 << 20, numpy.uint8)\n")
    cache = tmp_path / "cache"
    cost = measured_import_cost("holds_64mb", 1, str(cache))
    assert 64 * MB <= cost < 80 * MB
    kept = json.loads((cache / FILE).read_text())
    assert list(kept.values()) == [cost]
    # the kept number is what the next call returns, without a child
    key = next(iter(kept))
    (cache / FILE).write_text(json.dumps({key: 12345}))
    assert measured_import_cost("holds_64mb", 1, str(cache)) == 12345


def test_a_child_killed_while_importing_is_reported(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "killed_on_import", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    with pytest.raises(ImportKilled, match="killed_on_import"):
        measured_import_cost("killed_on_import", 1, str(tmp_path / "cache"))


def test_a_module_that_does_not_import_falls_back_to_the_estimate(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "broken_module", "raise ImportError('no')\n")
    assert measured_import_cost("broken_module", 777, str(tmp_path / "cache")) == 777
    assert not (tmp_path / "cache" / FILE).exists()


def test_a_backend_is_measured_started_not_only_imported(tmp_path):
    """backend=: the child starts the backend (the framework's import and what the backend sets up),
    what the caller goes through before it plans; kept under its own key."""
    cost = measured_import_cost("mlx.core", 1, str(tmp_path), backend="mlx")
    assert 0 < cost < 200 * MB
    kept = json.loads((tmp_path / FILE).read_text())
    assert [k.split()[0] for k in kept] == ["backend:mlx"] and list(kept.values()) == [cost]
