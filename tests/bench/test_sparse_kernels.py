"""`python -m mlx_flash.bench sparse-kernels` in its short form: the default model's FFN shape, a few
layers in rotation, one sparsity; the CPU member checked and timed, the absent GPU targets named as not run; bad
arguments refused in one line."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = [sys.executable, "-m", "mlx_flash.bench", "sparse-kernels"]


def run(*args):
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_short_run_checks_times_and_reports(tmp_path):
    out = tmp_path / "k.json"
    r = run(
        "--shapes",
        "default",
        "--bits",
        "4",
        "--sparsity",
        "0,50",
        "--layers",
        "3",
        "--rounds",
        "1",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "k.png"),
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(x["target"], x["sparsity"]) for x in rows] == [("cpu", 0), ("cpu", 50)]
    for x in rows:
        assert x["max_rel_error"] < 1e-5 and x["ms"] > 0 and x["gbs"] > 0 and x["speedup"] > 0
    assert (tmp_path / "k.png").stat().st_size > 0
    import mlx.core as mx

    if not mx.metal.is_available():
        assert "metal: not run: no Metal device" in r.stdout
    assert "cuda: not run" in r.stdout


def test_bad_arguments_are_one_line():
    r = run("--shapes", "13b")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "13b unknown" in r.stderr
    r = run("--sparsity", "100")
    assert r.returncode == 2 and "sparsity" in r.stderr and "Traceback" not in r.stderr
