"""Every file and every `module:name` the README and docs/ name exists, so the guide and the package
map cannot drift from the tree. In backticks: `module:name` (dotted attributes after the colon) is
imported and looked up; a path with a folder (`models/common.py`, `kernels/cpu/`, `qmatmul*.cpp`
patterns) must exist from the repository root or, for paths inside the package, from `mlx_flash/`;
a bare source file name (`window.py`) must exist somewhere in the tree. Files the engine writes at run
time (`manifest.json`, `~/.cache/...`) are not source files and are not checked."""

import glob
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
)
SOURCE = r"\.(?:py|cpp|h|cu|cuh|metal|ipynb|sh)"
REFERENCE = re.compile(r"^(mlx_flash(?:\.\w+)*):(\w+(?:\.\w+)*)$")
PATH = re.compile(r"^[\w*.-]+(?:/[\w*.-]+)+/?$")
DOTTED_PATH = re.compile(r"^\w+(?:/\w+)+\.[A-Za-z_][\w.]*$")  # models/cache.make_caches: written module:name instead
BARE = re.compile(r"^[\w*-]+" + SOURCE + "$")
TREE = ("mlx_flash", "kernels", "tools", "tests", "examples", ".ci")


def names_in(doc: str) -> list[str]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
        return [t.rstrip(".,:;") for t in re.findall(r"`([^`\s]+)`", fh.read())]


def resolves(ref: str) -> bool:
    module, attrs = REFERENCE.match(ref).groups()
    try:
        obj = importlib.import_module(module)
        for a in attrs.split("."):
            obj = getattr(obj, a)
    except (ImportError, AttributeError):
        return False
    return True


def path_exists(path: str) -> bool:
    if path.startswith(("~", "/", "http")) or "://" in path:
        return True  # not a path of the tree
    if path.startswith("mlx_flash/kernels"):  # kernels/ installs as mlx_flash/kernels
        path = path[len("mlx_flash/") :]
    return any(glob.glob(os.path.join(ROOT, base, path)) for base in ("", "mlx_flash"))


def bare_exists(name: str) -> bool:
    return any(glob.glob(os.path.join(ROOT, top, "**", name), recursive=True) for top in TREE) or bool(
        glob.glob(os.path.join(ROOT, name))
    )


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_file_and_function_exists(doc):
    bad = []
    for t in names_in(doc):
        if DOTTED_PATH.match(t) and not re.search(r"\.(?:py|cpp|h|cu|cuh|metal|ipynb|sh|md|json|toml|txt|png)$", t):
            bad.append(f"{t} (write it module:name)")
        elif REFERENCE.match(t):
            bad += [] if resolves(t) else [f"{t} (not importable)"]
        elif PATH.match(t) and (re.search(SOURCE + "$", t) or t.endswith("/") or "*" in t):
            bad += [] if path_exists(t) else [f"{t} (no such path)"]
        elif BARE.match(t):
            bad += [] if bare_exists(t) else [f"{t} (no such file)"]
    assert not bad, f"{doc} names what does not exist: " + ", ".join(sorted(set(bad)))


def test_the_checks_can_fail():
    assert resolves("mlx_flash.models.common:gated_mlp") and not resolves("mlx_flash.models.common:no_such")
    assert not resolves("mlx_flash.no_such_module:x")
    assert path_exists("kernels/cpu/gated_ffn.cpp") and path_exists("models/common.py")
    assert path_exists("mlx_flash/kernels/torch_ops.py")
    assert path_exists("kernels/cpu/qmatmul*.cpp") and not path_exists("models/no_such.py")
    assert bare_exists("window.py") and not bare_exists("no_such_file.py")
    assert "docs/architecture.md" in DOCS and len(DOCS) > 5
    assert DOTTED_PATH.match("models/cache.make_caches") and DOTTED_PATH.match("models/cache.py")
