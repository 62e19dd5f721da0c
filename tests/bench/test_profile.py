"""`python -m mlx_flash.bench profile` in its short form on the default model: the eager step's time, each
operator's share inside it (one fused FFN call per layer, as the torch backend makes), and a bad
argument refused in one line."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = [sys.executable, "-m", "mlx_flash.bench", "profile"]


def run(*args):
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_short_profile_names_the_kernels_of_a_step(tmp_path):
    out = tmp_path / "p.json"
    r = run("--tokens", "4", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    calls = {name: n for name, _, n in res["operators"]}
    assert calls["mlx_flash::gated_ffn"] == 30  # the default model's layers: one FFN call each
    assert calls["mlx_flash::attention"] == 30
    assert 0 < res["kernels_ms"] and 0 < res["eager_ms"]
    assert "| mlx_flash::gated_ffn |" in r.stdout


def test_too_few_tokens_is_refused_in_one_line():
    r = run("--tokens", "2")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--tokens" in r.stderr
