"""Run inside a venv holding only the built wheel (no source tree on sys.path): every module of the
package imports, torch and transformers are neither installed nor imported, and every file of the
source tree's kernels/ folder is readable through importlib.resources.

usage: python check_installed.py KERNELS_DIR
"""

import importlib
import importlib.resources
import importlib.util
import os
import pkgutil
import sys

import mlx_flash

kernels_dir = sys.argv[1]
here = os.path.dirname(os.path.abspath(mlx_flash.__file__))
assert "site-packages" in here, f"mlx_flash imported from {here}, not from the installed wheel"
for absent in ("torch", "transformers"):
    assert importlib.util.find_spec(absent) is None, f"{absent} is installed in the wheel's venv"

names = [m.name for m in pkgutil.walk_packages(mlx_flash.__path__, "mlx_flash.")]
for name in names:
    importlib.import_module(name)
subpackages = sorted(n for n in names if importlib.util.find_spec(n).submodule_search_locations)
for absent in ("torch", "transformers", "mlx_lm"):
    assert absent not in sys.modules, f"importing the package imported {absent}"

shipped = importlib.resources.files("mlx_flash.kernels")
count = 0
for root, dirs, files in os.walk(kernels_dir):
    dirs[:] = [d for d in dirs if d not in ("__pycache__", "torch_build")]  # torch_build: operators built at first use
    for f in files:
        if f.endswith((".so", ".pyd", ".dylib")):  # built here by an editable install, not a source file
            continue
        rel = os.path.relpath(os.path.join(root, f), kernels_dir)
        with open(os.path.join(root, f), "rb") as fh:
            assert shipped.joinpath(*rel.split(os.sep)).read_bytes() == fh.read(), f"kernels/{rel} not shipped"
        count += 1
from mlx_flash.kernels.qmatmul import cpu_isa  # noqa: E402  (compiled at install; raises if it was not)

print(f"CPU kernel compiled at install, running its {cpu_isa().name} path")
print(
    f"{len(names)} modules imported ({len(subpackages)} subpackages: {', '.join(subpackages)}); "
    f"{count} kernels/ files shipped; no torch, no transformers"
)
