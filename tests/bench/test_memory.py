"""`python -m mlx_flash.bench memory`, the memory-limit harness, in its short form: the default model at one
limit, a few tokens, our MLX rows and llama.cpp's when llama-cpp-python is installed. Limits need
root and a cgroup memory controller; elsewhere the test skips with the harness's own reason."""

import json
import os
import subprocess
import sys

import pytest

from mlx_flash.errors import FlashError
from mlx_flash.bench.cgroup import own_memory_cgroup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import peer_flags  # noqa: E402


def test_limits_are_refused_in_one_line_without_cgroups(tmp_path):
    with pytest.raises(FlashError, match="need Linux cgroups"):
        own_memory_cgroup(proc_cgroup=str(tmp_path / "missing"))
    if os.geteuid() == 0:  # a mount without the memory controller
        (tmp_path / "cgroup").write_text("0::/\n")
        with pytest.raises(FlashError, match="no cgroup memory controller"):
            own_memory_cgroup(proc_cgroup=str(tmp_path / "cgroup"), root=str(tmp_path))


def test_peer_flags_name_only_the_instruction_sets_the_cpu_has():
    args = peer_flags.cmake_args({"avx", "avx2", "fma", "f16c"}).split()
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args and "-DGGML_AMX_INT8=OFF" in args
    assert "-DGGML_AVX512=OFF" in args and "-DGGML_AVX512_VNNI=OFF" in args
    assert "-DGGML_AVX512=ON" in peer_flags.cmake_args({"avx512f"}).split()


def test_short_form_at_one_limit(default_gguf, tmp_path):
    try:
        own_memory_cgroup()
    except FlashError as e:
        pytest.skip(str(e))
    out = tmp_path / "bench.json"
    limit = 600_000_000
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_flash.bench",
            "memory",
            "--backends",
            "mlx",
            "--limits",
            "600MB",
            "--tokens",
            "4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    ours = [row for row in rows if row["engine"] == "mlx_flash"]
    assert [row["mode"] for row in ours] == ["mlx"]
    peers = [row for row in rows if row["engine"] == "llama.cpp"]
    if not peers:
        assert "llama.cpp skipped: llama-cpp-python is not installed" in r.stdout
    for row in rows:
        assert row["outcome"] == "ok", row
        assert row["limit"] == limit and row["oom_kills"] == 0
        assert 0 < row["peak_cgroup"] <= limit
        assert row["decode_tps"] > 0 and row["prefill_tps"] > 0
    assert ours[0]["plan_line"].startswith("memory: limit ")
