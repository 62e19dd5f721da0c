"""Conversion as a user may abuse it (the hardening probe's cases 3 and 4): killed converters leave
nothing behind once the next one starts, SIGTERM cleans up at once, two converters into one path
do not clobber each other, and an output that cannot be written is one line."""

import os
import signal
import subprocess
import sys
import time

import pytest

import tiny_models

from mlx_flash.store import open_store
from mlx_flash.store.atomic_dir import remove_dead_partials

CONVERT = [sys.executable, "-m", "mlx_flash.convert"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random llama large enough (~70 MB of float32) that writing it takes a moment to kill."""
    d = str(tmp_path_factory.mktemp("src") / "hf")
    tiny_models.build(
        "llama",
        d,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    return d


def leftovers(parent, out_name):
    """What a conversion into `out_name` left beside it: partial folders and its lock. The store's
    `.in-use` file is not among them: it marks the store's last use (store/in_use.py) and goes when
    the store is removed."""
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{out_name}.") and n != f".{out_name}.in-use")


def start(source, out, *extra):
    return subprocess.Popen(
        CONVERT + [source, out, "--force", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def kill_while_writing(source, out, sig) -> bool:
    """Start a converter and send `sig` once its partial directory exists; whether it was caught
    writing (False: it finished first)."""
    parent, name = os.path.dirname(out), os.path.basename(out)
    p = start(source, out)
    partial = os.path.join(parent, f".{name}.partial-{p.pid}")
    deadline = time.time() + 120
    while p.poll() is None and time.time() < deadline:
        if os.path.isdir(partial) and os.listdir(partial):
            p.send_signal(sig)
            p.wait(60)
            return True
        time.sleep(0.005)
    p.wait(60)
    return False


def test_nine_kills_leave_nothing_after_the_next_start(source, tmp_path):
    out = str(tmp_path / "store")
    kills = 0
    for _ in range(30):
        kills += kill_while_writing(source, out, signal.SIGKILL)
        if kills == 9:
            break
    assert kills == 9
    assert len([n for n in leftovers(str(tmp_path), "store") if ".partial-" in n]) >= 1  # what SIGKILL leaves
    r = subprocess.run(CONVERT + [source, out, "--force"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert leftovers(str(tmp_path), "store") == []  # partials of the dead and the lock: gone
    open_store(out, verify_checksums=True)


def test_sigterm_removes_its_partial_directory_at_once(source, tmp_path):
    out = str(tmp_path / "store")
    for _ in range(10):
        if kill_while_writing(source, out, signal.SIGTERM):
            break
    else:
        pytest.fail("the converter always finished before it could be stopped")
    assert leftovers(str(tmp_path), "store") == []
    assert not os.path.exists(out)


def test_two_converters_into_one_path_do_not_clobber(source, tmp_path):
    """Without --force: one writes the store, the other waits for it, then refuses (it exists)."""
    out = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            CONVERT + [source, out, "--precision", p], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for p in ("f16", "q8")
    ]
    results = [(p.wait(300), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 1], results
    loser = next(err for rc, _, err in results if rc == 1)
    assert "already exists" in loser and loser.strip().count("\n") <= 1 + loser.count("waiting for"), loser
    store = open_store(out, verify_checksums=True)
    winner = next(out_ for rc, out_, _ in results if rc == 0)
    assert f"({store.manifest.ffn.precision})" in winner
    assert leftovers(str(tmp_path), "store") == []


def test_dead_partials_are_found_by_their_pid(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f".a.partial-{dead.pid}", f".b.partial-{dead.pid}.old", f".c.partial-{os.getpid()}", ".d.partial-1"):
        os.makedirs(tmp_path / name / "sub")
        (tmp_path / name / "sub" / "x.bin").write_bytes(b"\0" * 4096)
    removed = remove_dead_partials(str(tmp_path))
    assert sorted(removed) == [f".a.partial-{dead.pid}"]
    # live: kept; b's old output, moved aside by a writer that died before its new one was in place, is back
    assert sorted(os.listdir(tmp_path)) == [f".c.partial-{os.getpid()}", ".d.partial-1", "b"]
    assert (tmp_path / "b" / "sub" / "x.bin").stat().st_size == 4096


def test_an_output_that_cannot_be_written_is_one_line(source, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = subprocess.run(CONVERT + [source, str(blocker / "store")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "file" in r.stderr and "Traceback" not in r.stderr


def test_an_output_in_a_folder_that_does_not_exist_yet(source, tmp_path):
    """The converter makes the output's folder (and its lock) first: the default model's first use
    converts into a cache folder that does not exist yet."""
    out = tmp_path / "new" / "deeper" / "store"
    r = subprocess.run(CONVERT + [source, str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    open_store(str(out))
    assert leftovers(str(out.parent), "store") == []
