"""The memory a process may use (cgroup v1 / v2 limits up its hierarchy, else the machine's) and
what a user's memory_budget means against it."""

import pytest

from mlx_flash.errors import ConfigError
from mlx_flash.memory import available as av
from mlx_flash.memory.available import Available
from mlx_flash.memory.limit import SAFETY_MIN, resolve_limit


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_takes_the_tightest_limit_up_the_hierarchy(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "12:cpu:/\n4:memory:/jobs/run7\n0::/\n")
    root = tmp_path / "fs"
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # no limit
    _write(root / "memory" / "jobs" / "memory.limit_in_bytes", "3000000000\n")
    _write(root / "memory" / "jobs" / "run7" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert av._cgroup_limit(str(proc), str(root)) == (3000000000, "cgroup v1 memory limit")


def test_cgroup_v2_memory_max(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/user.slice/app\n")
    root = tmp_path / "fs"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "user.slice" / "memory.max", "max\n")
    _write(root / "user.slice" / "app" / "memory.max", "2147483648\n")
    assert av._cgroup_limit(str(proc), str(root)) == (2147483648, "cgroup v2 memory.max")


def test_no_cgroup_limit(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/\n")
    root = tmp_path / "fs"
    _write(root / "cgroup.controllers", "memory\n")
    _write(root / "memory.max", "max\n")
    assert av._cgroup_limit(str(proc), str(root)) is None


def test_available_memory_is_plausible():
    a = available_memory = av.available_memory()
    assert 0 < a.bytes and a.source
    assert available_memory.bytes >= av.process_rss() > 0
    assert av.peak_rss() >= av.process_rss()


def test_limit_values():
    avail = Available(4_000_000_000, "cgroup v1 memory limit")
    auto = resolve_limit("auto", avail)
    assert auto.bytes == 4_000_000_000 - max(200_000_000, SAFETY_MIN) and "less" in auto.how
    assert resolve_limit("50%", avail).bytes == 2_000_000_000
    assert resolve_limit("1.5GB", avail).bytes == 1_500_000_000
    assert resolve_limit(1_000_000_000, avail).bytes == 1_000_000_000
    with pytest.raises(ConfigError, match="more than this process may use"):
        resolve_limit("5GB", avail)
    with pytest.raises(ConfigError, match="not understood"):
        resolve_limit("lots", avail)
