"""memory/allocator.py: with large arrays mapped on their own, freed ones leave the process's RSS
even after a large free (which raises glibc's moving threshold); without, they stay as holes."""

import subprocess
import sys

import pytest

from mlx_flash.memory.allocator import _glibc

SCRIPT = """
import sys
import numpy as np
from mlx_flash.memory import process_rss
from mlx_flash.memory.allocator import map_large_arrays
if sys.argv[1] == "fixed":
    assert map_large_arrays()
big = np.ones(20 << 20, np.uint8); del big  # a large free: glibc's default raises its threshold to 20 MiB
arrays = [np.ones(2 << 20, np.uint8) for _ in range(100)]  # 200 MiB of 2 MiB arrays
base = process_rss()
del arrays[::2]  # half of them freed, every other one: holes between live ones
print(base - process_rss())
"""


@pytest.mark.skipif(_glibc() is None, reason="glibc only (Linux)")
def test_freed_large_arrays_leave_rss_when_mapped_on_their_own():
    freed = {mode: int(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                                      check=True).stdout) for mode in ("moving", "fixed")}
    assert freed["fixed"] > 90 << 20, freed  # the 100 MiB freed came back
    assert freed["moving"] < 20 << 20, freed  # glibc's default keeps them
