"""The memory promise inside a real memory cgroup (root and a cgroup memory controller; skipped with
the reason elsewhere): below the minimum the engine states, the chat refuses in one line and exits
non-zero; at that minimum plus the auto margin it answers, never OOM-killed."""

import re
import sys

import pytest

from mlx_flash.errors import FlashError
from mlx_flash.bench.cgroup import MemoryCgroup, own_memory_cgroup
from mlx_flash.memory.limit import SAFETY_MIN
from progress_lines import without_progress

CHAT = [sys.executable, "-m", "mlx_flash.chat", "--prompt", "What is the capital of France?", "--max-tokens", "4"]


@pytest.fixture
def cgroups():
    try:
        own_memory_cgroup()
    except FlashError as e:
        pytest.skip(str(e))


def _auto_reaching(n: int) -> int:
    """The least cgroup limit whose "auto" budget (the limit less max(5%, 64 MB)) is n bytes or more."""
    return int(max(n / 0.95, n + SAFETY_MIN)) + 1_000_000


def _refusal(limit: int, store_dir: str) -> str:
    with MemoryCgroup(limit) as cg:
        low = cg.run(CHAT + ["--model", store_dir], timeout=120)
    assert low.returncode == 2 and low.oom_kills == 0, low.stderr
    lines = without_progress(low.stderr)
    assert len(lines) == 1 and "Traceback" not in low.stderr, low.stderr
    return lines[0]


@pytest.mark.slow
def test_refused_below_the_stated_minimum_and_alive_above_it(default_gguf, store_dir, cgroups):
    line = _refusal(150_000_000, store_dir)
    before = re.search(r"below the ([0-9.]+) MB this process reaches", line)
    if before:  # refused before the backend's import: at that number it plans, and names the model's minimum
        line = _refusal(_auto_reaching(int(float(before.group(1)) * 1e6)), store_dir)
    m = re.search(r"below the minimum ([0-9.]+) MB", line)
    assert m, line
    # the named minimum as "auto" (its run-to-run difference is in it: FLOOR_JITTER)
    limit = _auto_reaching(int(float(m.group(1)) * 1e6))
    with MemoryCgroup(limit) as cg:
        ok = cg.run(CHAT + ["--model", store_dir], timeout=300)
    assert ok.returncode == 0 and ok.oom_kills == 0, ok.stderr[-2000:]
    assert "Paris" in ok.stdout or ok.stdout.strip(), ok.stdout
    assert ok.peak <= limit
