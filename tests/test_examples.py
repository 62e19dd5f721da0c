"""Examples use only the public API and must keep running."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_runs(store_dir):
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--backend", "torch", "--model", store_dir],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("' Paris")
    assert "decode" in r.stdout
