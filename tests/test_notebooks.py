"""The example notebooks run top to bottom on the default model with the public API, and are
committed without outputs. Executed copies are written to a temp dir, never into examples/."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOKS = [
    "01_quickstart.ipynb",
    "02_flash_budget.ipynb",
    "03_moe_experts.ipynb",
    "04_disk_profile.ipynb",
    "05_service.ipynb",
    "06_batch.ipynb",
]
CELL_TIMEOUT = 600  # seconds; a whole notebook takes under ~2 minutes on the 2-core test machine
KERNEL = "mlx-flash-tests"
REQUIRE = os.environ.get("MLX_FLASH_REQUIRE_DATA") == "1"


def _missing(reason: str):
    if REQUIRE:
        pytest.fail(f"required test dependency missing: {reason}")
    pytest.skip(reason)


def _read(name: str) -> dict:
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as fh:
        return json.load(fh)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    nb = _read(name)
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{name}: cell {i} has outputs"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_uses_the_public_api_only(name):
    """Every name a notebook takes from mlx_flash is in mlx_flash.__all__; no subpackage imports."""
    import mlx_flash

    for cell in _read(name)["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        assert not re.search(r"^\s*(from|import)\s+mlx_flash\.", src, re.M), f"{name} imports a subpackage"
        assert not re.search(r"^\s*from\s+mlx_flash\s+import", src, re.M), f"{name}: use mlx_flash.NAME"
        for attr in re.findall(r"\bmlx_flash\.(\w+)", src):
            assert attr in mlx_flash.__all__, f"{name} uses mlx_flash.{attr}, which is not public"


@pytest.fixture(scope="session")
def kernel_dir(tmp_path_factory) -> str:
    """A Jupyter data dir holding one kernelspec that runs this interpreter, so the notebooks run with
    the packages under test whatever kernels the machine has installed."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "mlx_flash tests",
                "language": "python",
            }
        )
    )
    return str(root)


# The quickstart and the service run in the default tier; the others (1-2 minutes each) in the full one.
RUN = [n if n == "01_quickstart.ipynb" else pytest.param(n, marks=pytest.mark.full) for n in NOTEBOOKS]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN)
def test_notebook_runs(name, default_gguf, kernel_dir, tmp_path, monkeypatch):
    for module in ("nbclient", "nbformat", "ipykernel"):
        if importlib.util.find_spec(module) is None:
            _missing(f"{module} is not installed (pip install -e '.[dev]'); the notebooks cannot run")
    import nbclient
    import nbformat

    monkeypatch.setenv("JUPYTER_PATH", kernel_dir)  # the kernel inherits the rest (MLX_FLASH_CACHE included)
    nb = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name=KERNEL, resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.perf_counter()
    try:
        client.execute()
    finally:
        nbformat.write(nb, str(tmp_path / name))  # the executed copy, to look at when a cell fails
    print(f"{name}: {time.perf_counter() - t0:.1f} s")
    images = sum(
        "image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert images >= 1, f"{name} drew no plot"
