"""Every file the package writes beside or into a store, each write failed one at a time
(tests/fault_injection.py): a conversion, sparsity thresholds, sparsity predictors. Each refuses in
one line, leaves nothing half-written that its reader takes for good, and works when run again; with
-s each prints its injection points by kind. Then the harness itself: a bug's traceback is shown,
and a file written in place is caught half-written. (Faults while serving and generating:
tests/test_fault_injection_runtime.py.)"""

from __future__ import annotations

import itertools
import os
import shutil
import traceback

import numpy as np
import pytest

import fault_injection as fi
import mlx_flash
import tiny_models
from fault_injection import show, store_files
from fuzz_helpers import templated_store
from mlx_flash.errors import DiskError
from mlx_flash.sparse.predictor import LayerPredictor, Predictors
from mlx_flash.sparse.thresholds import PERCENTS, ROLES, Thresholds, load_thresholds, save_thresholds
from mlx_flash.sparse.thresholds import store_fingerprint
from mlx_flash.store.positional_io import write_all

_folders = itertools.count()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return templated_store(tmp_path_factory.mktemp("faults-store"))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A fresh folder per call (one per faulted run)."""
    root = tmp_path_factory.mktemp("faults")
    return lambda: str(root / f"run{next(_folders)}")


# ---- sparsity thresholds beside a store -----------------------------------------------------------


def linked_store(store: str, work) -> str:
    """A copy of the store whose files are hard links (the operations here add files beside them)."""
    copy = work()
    shutil.copytree(store, copy, copy_function=os.link)
    return copy


def leftovers(folder: str) -> list[str]:
    return [n for n in os.listdir(folder) if ".tmp" in n]


def thresholds_op(store, work) -> fi.Operation:
    opened = mlx_flash.store.open_store(store)
    layers = opened.config["num_hidden_layers"]
    rng = np.random.default_rng(0)
    found = Thresholds(
        {r: np.sort(rng.random((layers, PERCENTS), dtype=np.float32), axis=1) for r in ROLES},
        store_fingerprint(opened),
        {"corpus": "synthetic"},
    )

    def setup():
        return mlx_flash.store.open_store(linked_store(store, work))  # (its checksums stamped here)

    def run(opened):
        save_thresholds(opened, found)
        return found.to_json()

    def read_back(opened):
        assert leftovers(opened.path) == [], leftovers(opened.path)
        return load_thresholds(mlx_flash.store.open_store(opened.path), layers).to_json()

    return fi.Operation("sparsity thresholds", setup, run, read_back)


def test_thresholds_file_under_every_fault(store, work):
    report = fi.check(thresholds_op(store, work))
    show(report)
    assert report.by_kind() == {"write": 1, "fsync": 2, "rename": 1}  # one file, written durably


# ---- a conversion into a store ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("faults-hf") / "hf")
    tiny_models.build("llama", out)
    return out


def conversion_op(hf_dir, work) -> fi.Operation:
    def run(parent):
        out = mlx_flash.convert(hf_dir, os.path.join(parent, "store"), force=True, progress=False)
        return store_files(out)

    def read_back(parent):
        path = os.path.join(parent, "store")
        return store_files(path) if os.path.exists(path) else fi.ABSENT

    return fi.Operation("conversion into a store", work, run, read_back)


def test_conversion_under_every_fault(hf_dir, work):
    report = fi.check(conversion_op(hf_dir, work))
    show(report)
    assert report.by_kind()["fsync"] >= 4 and report.by_kind()["rename"] >= 1


# ---- sparsity predictors beside a store ------------------------------------------------------------


def predictors(layers: int, d: int, f: int, seed: int):
    rng = np.random.default_rng(seed)
    per = [
        LayerPredictor(rng.random((d, 4), np.float32), rng.random((4, f), np.float32), rng.random(f, np.float32), 0.1)
        for _ in range(layers)
    ]
    cuts = [0.1 * (seed + 1)] * layers
    return Predictors(per, 0.5, [0.01 * (seed + 1)] * layers, cuts_by_recall={"0.9": cuts}, recall="0.9")


def predictor_op(store, work) -> fi.Operation:
    """New predictors saved over older ones of the same shapes (a retraining); read back: each
    layer's U, V, b and cut, the magnitude thresholds."""

    cfg = mlx_flash.store.open_store(store).config
    shape = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"])
    old, new = predictors(*shape, seed=0), predictors(*shape, seed=1)

    def setup():
        path = linked_store(store, work)
        old.save(path)
        return path

    def run(path):
        new.save(path)
        return read_back(path)

    def read_back(path):
        assert leftovers(path) == [], leftovers(path)
        p = Predictors.load(path, *shape)
        return [(x.U, x.V, x.b, x.cut) for x in p.layers], p.magnitude_thresholds, p.cuts_by_recall

    return fi.Operation("sparsity predictors", setup, run, read_back)


def test_predictor_files_under_every_fault(store, work):
    report = fi.check(predictor_op(store, work))
    show(report)
    assert report.by_kind()["fsync"] >= 4 and report.by_kind()["rename"] == 2  # two files


# ---- the harness itself: it shows a bug's traceback, and a bad file read as good -------------------


def test_a_bug_under_a_fault_fails_showing_its_traceback(store, work):
    """A TypeError raised at the first write (a stand-in for a bug the fault reaches) fails the check
    with FaultEscaped chained to it: its traceback, through the package's frames, is shown."""
    bug = TypeError("a bug at the first write")
    with pytest.raises(fi.FaultEscaped, match="TypeError escaped") as e:
        fi.check(thresholds_op(store, work), bug=bug)
    assert e.value.__cause__ is bug
    frames = [f.name for f in traceback.extract_tb(bug.__traceback__)]
    assert "save_thresholds" in frames and "write" in frames, frames
    shown = "".join(traceback.format_exception(e.value))  # what pytest prints for the failure
    assert "TypeError: a bug at the first write" in shown and "direct cause" in shown
    assert "mlx_flash/durable.py" in shown, shown


def test_a_file_written_in_place_is_caught_half_written(work):
    """A file written in two parts in place (no temporary, no rename): a failed part leaves a file
    (empty, or half) that its reader takes for the whole: the check says so."""

    data = bytes(range(256)) * 64

    def run(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for at in (0, len(data) // 2):
                write_all(fd, memoryview(data[at : at + len(data) // 2]), at)
        except OSError as e:
            raise DiskError(f"{path}: {e.strerror}") from None
        finally:
            os.close(fd)
        return data

    def read_back(path):
        if not os.path.exists(path):
            return fi.ABSENT
        with open(path, "rb") as f:
            return f.read()

    op = fi.Operation("a file written in place", lambda: work() + ".bin", run, read_back)
    with pytest.raises(fi.FaultEscaped, match="point 0 .*neither the old one nor the new one"):
        fi.check(op)
