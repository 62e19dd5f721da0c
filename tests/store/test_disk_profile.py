"""Disk profile: measured on a small scratch file, plotted, and used to size the stream-mode pool."""

import json

import pytest

from mlx_flash.store import disk_profile as dp

KiB = 1024


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    d = tmp_path_factory.mktemp("disk")
    scratch = dp.make_scratch_file(str(d / "scratch.bin"), 16 * 1024 * KiB)
    return dp.profile_disk(scratch, chunks=[4 * KiB, 64 * KiB], threads=[1, 2], seconds=0.05), d


def test_profile_has_every_cell(profile):
    prof, _ = profile
    assert set(prof["throughput"]) == {"1", "2"}
    assert all(
        set(row) == {"4096", "65536"} and all(v > 0 for v in row.values()) for row in prof["throughput"].values()
    )
    assert 0 < prof["latency_s"] < 1
    assert dp.coalesce_gap(prof) % 4096 == 0
    assert dp.best_threads(prof, 60 * KiB) in (1, 2)


def test_plot_and_saved_json(profile):
    prof, d = profile
    png, js = d / "p.png", d / "p.json"
    dp.plot_profile(prof, str(png))
    dp.save_profile(prof, str(js))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(js.read_text())["throughput"] == prof["throughput"]


def test_default_profile_is_cached(tmp_path, monkeypatch):
    calls = []
    real = dp.profile_disk

    def small(path, chunks, threads, seconds):
        calls.append(path)
        return real(path, chunks=[4 * KiB], threads=[1], seconds=0.02)

    monkeypatch.setattr(dp, "profile_disk", small)
    monkeypatch.setattr(dp, "make_scratch_file", lambda p, n: _make(p))  # 1 MiB instead of 256 MiB
    a = dp.default_profile(str(tmp_path))
    b = dp.default_profile(str(tmp_path))
    assert a == b and len(calls) == 1 and a["quick_probe"]
    assert not list(tmp_path.glob(".probe*"))  # the scratch file is removed


def _make(path):
    with open(path, "wb") as fh:
        fh.write(b"\1" * (1024 * KiB))
    return path
