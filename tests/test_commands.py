"""The user-facing commands: every console script in pyproject.toml names a module's main, and each
runs as `python -m` (in a fresh process: importing mlx_flash.profile_disk by name would rebind the
public function mlx_flash.profile_disk in this one)."""

import os
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _fh:
    SCRIPTS = tomllib.load(_fh)["project"]["scripts"]


def python(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_the_commands_have_console_scripts():
    assert set(SCRIPTS) == {
        "mlx-flash-chat",
        "mlx-flash-serve",
        "mlx-flash-batch",
        "mlx-flash-convert",
        "mlx-flash-verify",
        "mlx-flash-profile-disk",
        "mlx-flash-models",
        "mlx-flash-sparsify",
    }


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_entry_points_exist_and_run(script):
    module, func = SCRIPTS[script].split(":")
    code = f"import sys; from {module} import {func}; sys.argv[0] = {script!r}; sys.exit({func}(['--help']))"
    r = python("-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ")


@pytest.mark.parametrize(
    "module",
    [
        "mlx_flash.chat",
        "mlx_flash.serve",
        "mlx_flash.batch",
        "mlx_flash.convert",
        "mlx_flash.verify",
        "mlx_flash.profile_disk",
    ],
)
def test_python_m_help(module):
    r = python("-m", module, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m {module} ")


def test_convert_command_writes_a_store_and_fails_in_one_line(tmp_path):
    import tiny_models

    src = str(tmp_path / "hf")
    tiny_models.build("llama", src)
    r = python("-m", "mlx_flash.convert", src, str(tmp_path / "store"), "--precision", "f16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"store {tmp_path / 'store'}: llama, ")
    r = python("-m", "mlx_flash.convert", str(tmp_path / "missing"), str(tmp_path / "store2"))
    assert r.returncode == 1 and "Traceback" not in r.stderr  # progress lines, then one error line
    assert r.stderr.splitlines()[-1] == f"error: {tmp_path / 'missing'}: no such file or directory"
