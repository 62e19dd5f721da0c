"""`python -m mlx_flash.bench` (mlx_flash/bench/__main__.py): its list names every command module of
mlx_flash/bench/commands/ (read from the folder, so a command without an entry in COMMANDS fails),
each command answers --help under its own name, an unknown name is refused in one line with exit
status 2, and a FlashError a command lets through is one line with exit status 1."""

import ast
import os
import subprocess
import sys
import types

import pytest

from mlx_flash.bench import __main__ as bench_main
from mlx_flash.errors import FlashError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMANDS_DIR = os.path.join(ROOT, "mlx_flash", "bench", "commands")


def command_modules() -> dict[str, ast.Module]:
    """module name -> parsed source, for each module of commands/ that defines main (the others are a
    command's parts, such as memory_report.py)."""
    out = {}
    for f in sorted(os.listdir(COMMANDS_DIR)):
        if f.endswith(".py") and f != "__init__.py":
            with open(os.path.join(COMMANDS_DIR, f), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
                out[f[: -len(".py")]] = tree
    return out


def bench(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "mlx_flash.bench", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_the_table_names_every_command_module_once():
    modules = [module for module, _ in bench_main.COMMANDS.values()]
    assert sorted(modules) == sorted(command_modules())
    for name, (module, summary) in bench_main.COMMANDS.items():
        assert name == module.replace("_", "-")
        assert summary and "\n" not in summary and len(summary) < 100


def test_help_lists_every_command_with_its_summary():
    r = bench("--help")
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith("usage: python -m mlx_flash.bench NAME [args]")
    for module in command_modules():
        name = module.replace("_", "-")
        assert any(ln.split()[:1] == [name] and bench_main.COMMANDS[name][1] in ln for ln in r.stdout.splitlines())
    assert bench().stdout == r.stdout  # no name: the same list


def test_an_unknown_name_is_one_line_and_exit_2():
    r = bench("no-such-bench")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("mlx_flash.bench: unknown benchmark 'no-such-bench' (choose from arithmetic, ")


def test_a_flash_error_a_command_lets_through_is_one_line_and_exit_1(monkeypatch, capsys):
    def main(argv):
        raise FlashError(f"refused {argv}")

    monkeypatch.setitem(sys.modules, "mlx_flash.bench.commands.refuses", types.SimpleNamespace(main=main))
    monkeypatch.setitem(bench_main.COMMANDS, "refuses", ("refuses", "raises"))
    assert bench_main.main(["refuses", "--x"]) == 1
    assert capsys.readouterr().err == "error: refused ['--x']\n"


@pytest.mark.parametrize("module", sorted(command_modules()))
def test_each_command_names_itself_in_its_usage_and_help(module):
    name = module.replace("_", "-")
    doc = ast.get_docstring(command_modules()[module])
    assert f"python -m mlx_flash.bench {name}" in doc  # its docstring's usage line
    r = bench(name, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m mlx_flash.bench {name} ")
