"""The store cache a user manages (mlx_flash/locate/cached_stores.py, python -m mlx_flash.stores):
sizes equal the files on disk, the converter version is read from the manifest, prune takes the
older stores and dead conversions only, and a store an engine or a conversion holds is refused."""

import gc
import json
import os
import shutil
import subprocess
import sys

import pytest

import tiny_models
from mlx_flash.cli.models import main as models_main
from mlx_flash.convert import CONVERTER_VERSION
from mlx_flash.default_model import resolve_store
from mlx_flash.errors import ConfigError, StoreError
from mlx_flash.locate.cached_stores import find, list_stores, prune, remove
from mlx_flash.store import open_store
from mlx_flash.store.atomic_dir import output_lock
from mlx_flash.store.in_use import hold
from mlx_flash.units import fmt


@pytest.fixture
def cache(tmp_path):
    """A cache with one store converted on first use, as load() converts a model."""
    tiny_models.build("llama", str(tmp_path / "tiny-hf"))
    cache = str(tmp_path / "cache")
    path = resolve_store(str(tmp_path / "tiny-hf"), cache, progress=False)
    return cache, path


def _bytes_on_disk(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _older_copy(path, version):
    """A copy of the store as an older converter would have left it (`version` None: unrecorded)."""
    old = os.path.join(os.path.dirname(path), f"old-{version}")
    shutil.copytree(path, old)
    mpath = os.path.join(old, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    if version is None:
        m["source"].pop("converter_version")
    else:
        m["source"]["converter_version"] = version
    with open(mpath, "w") as f:
        json.dump(m, f)
    return old


def test_list_reports_source_size_and_version(cache):
    cache_dir, path = cache
    [s] = list_stores(cache_dir)
    assert s.path == path and s.name == os.path.basename(path)
    assert s.source == "tiny-hf"
    assert s.size == _bytes_on_disk(path) > 0
    assert s.converter_version == CONVERTER_VERSION and not s.outdated
    assert s.last_used > 0


def test_opening_a_store_marks_its_last_use(cache):
    cache_dir, path = cache
    os.utime(os.path.join(path, "manifest.json"), (1_000_000, 1_000_000))
    before = list_stores(cache_dir)[0].last_used
    store = open_store(path)
    assert list_stores(cache_dir)[0].last_used > before
    del store


def test_prune_removes_older_converters_and_dead_conversions_only(cache, tmp_path):
    cache_dir, path = cache
    older = _older_copy(path, CONVERTER_VERSION - 1)
    unrecorded = _older_copy(path, None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dead_partial = os.path.join(cache_dir, "stores", f".x.partial-{dead.pid}")
    live_partial = os.path.join(cache_dir, "stores", f".y.partial-{os.getpid()}")
    os.makedirs(dead_partial)
    os.makedirs(live_partial)
    stores = os.path.join(cache_dir, "stores")
    orphan = os.path.join(stores, ".gone.lock")  # a killed conversion's lock, its store never written
    kept_locks = [os.path.join(stores, f".{os.path.basename(path)}.in-use"), os.path.join(stores, ".y.lock")]
    for lock in [orphan] + kept_locks:
        open(lock, "w").close()
    removed, kept = prune(cache_dir)
    assert not os.path.exists(orphan) and all(os.path.exists(p) for p in kept_locks)
    assert sorted(s.path for s in removed) == sorted([older, unrecorded, dead_partial])
    assert kept == [f"y: being converted (process {os.getpid()})"]
    assert os.path.isdir(path) and os.path.isdir(live_partial)
    assert not any(os.path.exists(p) for p in (older, unrecorded, dead_partial))


def test_remove_refuses_a_store_an_engine_holds(cache):
    cache_dir, path = cache
    store = open_store(path)
    with pytest.raises(StoreError, match="a running engine holds it"):
        remove(find(cache_dir, os.path.basename(path)))
    assert os.path.isdir(path)
    del store
    gc.collect()
    remove(find(cache_dir, "tiny-hf"))  # (by the name of its source)
    assert not os.path.exists(path) and list_stores(cache_dir) == []


def test_remove_refuses_a_store_being_converted(cache):
    cache_dir, path = cache
    with output_lock(path, progress=False):
        with pytest.raises(StoreError, match="a conversion is writing it"):
            remove(find(cache_dir, os.path.basename(path)))
    assert os.path.isdir(path)


def test_prune_keeps_an_old_store_an_engine_holds(cache, capsys):
    cache_dir, path = cache
    older = _older_copy(path, 1)
    held = hold(older)  # what an open Store holds (its manifest's seal no longer matches this edited copy)
    assert models_main(["--cache-dir", cache_dir, "prune", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"would keep {os.path.basename(older)}: a running engine holds it; close that engine first",
        "0 to remove, 0.0 MB",
    ]
    removed, kept = prune(cache_dir)
    assert removed == [] and kept == [f"{os.path.basename(older)}: a running engine holds it; close that engine first"]
    held.close()
    assert [s.path for s in prune(cache_dir)[0]] == [older]


def test_find_names_what_exists(cache):
    cache_dir, path = cache
    with pytest.raises(ConfigError, match=f"no store 'nope' .* {os.path.basename(path)}"):
        find(cache_dir, "nope")


def test_cli_list_remove_prune(cache, capsys):
    cache_dir, path = cache
    name = os.path.basename(path)
    assert models_main(["--cache-dir", cache_dir, "list"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {os.path.join(cache_dir, 'stores')}" in out and name in out and "tiny-hf" in out
    assert models_main(["--cache-dir", cache_dir, "remove", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no store 'nope'") and err.count("\n") == 1
    _older_copy(path, 2)
    assert models_main(["--cache-dir", cache_dir, "prune", "--dry-run"]) == 0
    assert "would remove old-2" in capsys.readouterr().out and os.path.isdir(os.path.join(cache_dir, "stores", "old-2"))
    assert models_main(["--cache-dir", cache_dir, "prune"]) == 0
    assert "removed old-2" in capsys.readouterr().out
    assert models_main(["--cache-dir", cache_dir, "remove", name]) == 0
    assert f"removed {name}" in capsys.readouterr().out and not os.path.exists(path)


def test_cli_as_a_user_runs_it(cache):
    cache_dir, _ = cache
    r = subprocess.run(
        [sys.executable, "-m", "mlx_flash.stores", "--cache-dir", cache_dir, "remove", "nope"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.startswith("error: no store")


def _broken_copies(path):
    """Copies of the store broken as a user meets them: the manifest gone, not JSON, not a store's,
    unreadable (a folder where the file should be); name -> the reason list_stores gives."""
    stores = os.path.dirname(path)
    why = {
        "gone": "no manifest.json",
        "garbled": "manifest.json is not valid JSON",
        "foreign": "manifest.json is not a store manifest",
        "unreadable": "manifest.json cannot be read (Is a directory)",
    }
    for name in why:
        shutil.copytree(path, os.path.join(stores, name))
        os.remove(os.path.join(stores, name, "manifest.json"))
    with open(os.path.join(stores, "garbled", "manifest.json"), "w") as f:
        f.write('{"format": "mlx_flash.st')
    with open(os.path.join(stores, "foreign", "manifest.json"), "w") as f:
        json.dump({"format": "something else"}, f)
    os.mkdir(os.path.join(stores, "unreadable", "manifest.json"))
    return why


def test_a_broken_store_is_listed_counted_removed_and_pruned(cache, capsys):
    cache_dir, path = cache
    why = _broken_copies(path)
    stores = {s.name: s for s in list_stores(cache_dir)}
    assert {n: s.broken for n, s in stores.items() if s.broken} == why
    assert not stores[os.path.basename(path)].broken
    for name in why:
        assert stores[name].size == _bytes_on_disk(os.path.join(cache_dir, "stores", name)) > 0
        assert not stores[name].outdated
    assert models_main(["--cache-dir", cache_dir, "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("gone ") and "(broken: no manifest.json)" in line for line in out)
    total = sum(s.size for s in stores.values())
    assert out[-1].startswith(f"5 stores, {fmt(total)}; prune removes 4 (")
    assert out[-1].endswith("older converter, broken or unfinished")
    remove(find(cache_dir, "gone"))
    assert not os.path.exists(os.path.join(cache_dir, "stores", "gone"))
    assert models_main(["--cache-dir", cache_dir, "prune", "--dry-run"]) == 0
    broken = ("foreign", "garbled", "unreadable")
    assert capsys.readouterr().out.splitlines() == [f"would remove {n} ({fmt(stores[n].size)})" for n in broken] + [
        f"3 to remove, {fmt(sum(stores[n].size for n in broken))}"
    ]
    removed, kept = prune(cache_dir)
    assert [s.name for s in removed] == list(broken) and kept == []
    assert [s.path for s in list_stores(cache_dir)] == [path]


def test_a_broken_store_an_engine_holds_is_refused(cache):
    cache_dir, path = cache
    store = open_store(path)
    os.remove(os.path.join(path, "manifest.json"))  # (the open store has it read already)
    [s] = list_stores(cache_dir)
    assert s.broken == "no manifest.json"
    with pytest.raises(StoreError, match="a running engine holds it"):
        remove(find(cache_dir, s.name))
    assert prune(cache_dir) == ([], [f"{s.name}: a running engine holds it; close that engine first"])
    assert os.path.isdir(path)
    del store
    gc.collect()
    assert [r.path for r in prune(cache_dir)[0]] == [path] and not os.path.exists(path)


def test_prune_help_says_what_it_removes(capsys):
    with pytest.raises(SystemExit):
        models_main(["prune", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "older converter" in said and "the broken ones (manifest.json gone" in said and "died half-way" in said
