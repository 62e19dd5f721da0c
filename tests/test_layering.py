"""The package's layers, read from its source with ast (nothing is imported): store/ deals in bytes
(no framework, no model, no compute), backends/ know no store, sparse/ (LLM in a flash) and moe/
(EdgeMoE) ignore each other, the per-token path never reaches offline code (calibrate/) or
conversion (convert/), calibrate/ is reached from outside only through the public re-exports of
mlx_flash/__init__.py, and no runtime package imports the measuring harnesses of bench/. Relative
imports are resolved; imports inside functions count too."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mlx_flash")
KERNELS_DIR = os.path.join(os.path.dirname(PACKAGE_DIR), "kernels")  # installed as mlx_flash.kernels

PER_TOKEN_PATH = (
    "mlx_flash.engine",
    "mlx_flash.generation",
    "mlx_flash.runner",
    "mlx_flash.batching",
    "mlx_flash.models",
    "mlx_flash.backends",
    "mlx_flash.sparse",
    "mlx_flash.moe",
    "mlx_flash.store",
    "mlx_flash.weights",
    "mlx_flash.ffn_source",
    "mlx_flash.sampling",
    "mlx_flash.speculative",
    "mlx_flash.tokenizer",
)


def within(name: str, prefixes) -> bool:
    """`name` is one of `prefixes` or inside one of them ("mlx" holds "mlx.core", not "mlx_flash")."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Rule:
    name: str
    importers: tuple  # modules the rule applies to (prefixes)
    forbidden: tuple  # modules they must not import (prefixes)
    exempt: tuple = ()  # modules among the importers that the rule leaves out (exact names)
    exempt_within: tuple = ()  # ... and packages it leaves out (prefixes)

    def applies_to(self, module: str) -> bool:
        return within(module, self.importers) and module not in self.exempt and not within(module, self.exempt_within)


RULES = (
    Rule(
        "store/ deals in bytes: no framework, no model, no compute",
        ("mlx_flash.store",),
        (
            "mlx",
            "torch",
            "mlx_flash.models",
            "mlx_flash.backends",
            "mlx_flash.convert",
            "mlx_flash.sparse",
            "mlx_flash.moe",
            "mlx_flash.calibrate",
            "mlx_flash.engine",
            "mlx_flash.api",
            "mlx_flash.weights",
        ),
    ),
    Rule("backends/ compute on arrays and know no store", ("mlx_flash.backends",), ("mlx_flash.store",)),
    Rule("sparse/ does not import moe/", ("mlx_flash.sparse",), ("mlx_flash.moe",)),
    Rule("moe/ does not import sparse/", ("mlx_flash.moe",), ("mlx_flash.sparse",)),
    Rule(
        "the per-token path imports no offline (calibrate/) or conversion (convert/) code",
        PER_TOKEN_PATH,
        ("mlx_flash.calibrate", "mlx_flash.convert"),
    ),
    Rule(
        "memory/ asks store/ for a model's sizes: it imports neither sparse/ nor moe/ (which plan under it)",
        ("mlx_flash.memory",),
        ("mlx_flash.sparse", "mlx_flash.moe"),
    ),
    Rule(
        "no runtime package imports bench/ (the measuring harnesses of tools/ and tests, above what they measure)",
        ("mlx_flash",),
        ("mlx_flash.bench",),
        exempt_within=("mlx_flash.bench",),
    ),
    Rule(
        "calibrate/ is imported from outside it only by mlx_flash/__init__.py (public re-exports), by"
        " bench/ (the harnesses score perplexity on its corpora) and by the offline commands over it"
        " (cli/sparsify.py)",
        ("mlx_flash",),
        ("mlx_flash.calibrate",),
        exempt=("mlx_flash", "mlx_flash.cli.sparsify"),
        exempt_within=("mlx_flash.calibrate", "mlx_flash.bench"),
    ),
)


# Rules on the imports run at import time only (imports_of(..., module_level=True)).
MODULE_LEVEL_RULES = (
    Rule(
        "the chat's start does not import distributed/ at module level: it is entered for --pipeline only",
        ("mlx_flash.cli.chat", "mlx_flash.chat"),
        ("mlx_flash.distributed",),
    ),
)


def module_name(path: str, root: str) -> tuple[str, bool]:
    """(dotted module name, is a package's __init__) of a file under `root` (the package directory)."""
    rel = os.path.relpath(path, os.path.dirname(root))[: -len(".py")].split(os.sep)
    is_pkg = rel[-1] == "__init__"
    return ".".join(rel[:-1] if is_pkg else rel), is_pkg


def _nodes(tree, module_level: bool):
    """Every node of the tree; module_level: not those inside functions (run when called, not at import)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports_of(path: str, module: str, is_pkg: bool, module_level: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file (module_level: those run at import,
    not inside functions). `from X import a` yields X and X.a, since `a` may be a submodule
    (`from .. import calibrate`)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    out = []
    for node in _nodes(tree, module_level):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_pkg else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
    return out


def import_map(root: str, prefix: str = "", module_level: bool = False) -> dict[str, tuple[str, list[tuple[int, str]]]]:
    """module -> (file, its imports) for every .py file under `root`; `prefix` goes before each module
    name (kernels/ is installed as mlx_flash.kernels: prefix "mlx_flash."); module_level: only the
    imports run at import time."""
    out = {}
    for d, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                module, is_pkg = module_name(path, root)
                out[prefix + module] = (path, imports_of(path, prefix + module, is_pkg, module_level))
    return out


def violations(imports: dict, rules=RULES) -> list[str]:
    """One message per (file, line, rule) broken: "file:line: imports X (rule: ...)"."""
    found = {}
    for module, (path, imported) in sorted(imports.items()):
        for rule in rules:
            if rule.applies_to(module):
                for line, name in imported:
                    if within(name, rule.forbidden):
                        found.setdefault((path, line, rule.name), f"{path}:{line}: imports {name} (rule: {rule.name})")
    return sorted(found.values())


def test_the_package_keeps_its_layers():
    bad = violations(import_map(PACKAGE_DIR))
    assert not bad, "layering broken:\n" + "\n".join(bad)


LEAVES = tuple(
    f"mlx_flash.{m}"
    for m in (
        "errors",
        "choices",
        "units",
        "quant_spec",
        "host_memory",
        "progress",
        "slot_turns",
        "ffn_source",
        "speculative",
    )
)
FLOOR = (  # (importers, the only modules of mlx_flash they may import besides their own package)
    (LEAVES, ()),
    (("mlx_flash.options", "mlx_flash.models"), LEAVES),
    (("mlx_flash.config",), LEAVES + ("mlx_flash.options",)),
    (("mlx_flash.kernels",), LEAVES + ("mlx_flash.config",)),
)


def floor_violations(imports: dict) -> list[str]:
    """One message per import of mlx_flash, by a module of FLOOR, outside what its row allows."""
    bad = set()
    for importers, allowed in FLOOR:
        for module, (path, imported) in imports.items():
            if within(module, importers):
                own = tuple(p for p in importers if within(module, (p,)))
                bad |= {
                    f"{path}:{line}: imports {name}"
                    for line, name in imported
                    if within(name, ("mlx_flash",)) and not within(name, own + allowed)
                }
    return sorted(bad)


def test_the_module_level_rules_hold():
    bad = violations(import_map(PACKAGE_DIR, module_level=True), MODULE_LEVEL_RULES)
    assert not bad, "layering broken at import time:\n" + "\n".join(bad)
    fake = {
        "mlx_flash.cli.chat": ("chat.py", [(1, "mlx_flash.distributed.launch"), (2, "mlx_flash.api")]),
        "mlx_flash.cli.serve": ("serve.py", [(3, "mlx_flash.distributed.serving")]),
    }
    assert [v.split(" (rule")[0] for v in violations(fake, MODULE_LEVEL_RULES)] == [
        "chat.py:1: imports mlx_flash.distributed.launch"
    ]


def test_the_floor_imports_only_the_floor():
    """The bottom of the package (docs/architecture.md): the leaves import nothing of the package, options
    and the graphs (models/) only leaves, config leaves and options, kernels/ leaves and config. Everything
    above imports them; one upward import here makes a circle or drags backends and stores into modules
    that every command, converter and kernel test imports."""
    imports = {**import_map(PACKAGE_DIR), **import_map(KERNELS_DIR, "mlx_flash.")}
    assert "mlx_flash.kernels.qmatmul" in imports and all(m in imports for m in LEAVES)
    bad = floor_violations(imports)
    assert not bad, "upward imports from the floor:\n" + "\n".join(bad)
    fake = {
        "mlx_flash.units": ("units.py", [(1, "mlx_flash.errors")]),
        "mlx_flash.kernels.q": ("q.py", [(2, "mlx_flash.kernels.r"), (3, "mlx_flash.store.bundles")]),
        "mlx_flash.models.llama": ("llama.py", [(4, "mlx_flash.ffn_source"), (5, "mlx_flash")]),
    }
    assert floor_violations(fake) == [
        "llama.py:5: imports mlx_flash",
        "q.py:3: imports mlx_flash.store.bundles",
        "units.py:1: imports mlx_flash.errors",
    ]


def test_the_scan_sees_the_whole_package():
    imports = import_map(PACKAGE_DIR)
    for module in (
        "mlx_flash",
        "mlx_flash.engine",
        "mlx_flash.store.manifest",
        "mlx_flash.backends.torch",
        "mlx_flash.sparse.cached_rows",
        "mlx_flash.moe.experts",
        "mlx_flash.calibrate",
        "mlx_flash.convert.converter",
    ):
        assert module in imports, f"{module} was not scanned"
    _, init = imports["mlx_flash"]
    assert "mlx_flash.calibrate" in {n for _, n in init}, "the lazy moefy re-export is an import of calibrate"


def test_each_rule_catches_its_violation():
    fake = {
        "mlx_flash.store.a": (
            "store/a.py",
            [
                (1, "torch"),
                (2, "mlx.core"),
                (3, "mlx_flash.models.llama"),
                (4, "mlx_flash.store.manifest"),
                (5, "numpy"),
            ],
        ),
        "mlx_flash.backends.mlx": ("backends/mlx.py", [(6, "mlx.core"), (7, "mlx_flash.store.manifest")]),
        "mlx_flash.sparse.a": ("sparse/a.py", [(8, "mlx_flash.moe.routing")]),
        "mlx_flash.moe.a": ("moe/a.py", [(9, "mlx_flash.sparse.planner")]),
        "mlx_flash.engine": ("engine.py", [(10, "mlx_flash.calibrate.routes")]),
        "mlx_flash.models.llama": ("models/llama.py", [(11, "mlx_flash.convert")]),
        "mlx_flash.chat": ("chat.py", [(12, "mlx_flash.calibrate")]),
        "mlx_flash": ("__init__.py", [(13, "mlx_flash.calibrate")]),  # allowed: public re-exports
        "mlx_flash.calibrate.a": ("calibrate/a.py", [(14, "mlx_flash.sparse.x"), (15, "mlx_flash.calibrate.b")]),
        "mlx_flash.convert.a": ("convert/a.py", [(16, "mlx_flash.models")]),  # allowed: convert may read models
        "mlx_flash.memory.a": ("memory/a.py", [(17, "mlx_flash.bench.cgroup")]),
        "mlx_flash.service.a": ("service/a.py", [(18, "mlx_flash.bench")]),
        "mlx_flash.bench.a": ("bench/a.py", [(19, "mlx_flash.bench.cgroup"), (20, "mlx_flash.service.service")]),
        "mlx_flash.memory.b": ("memory/b.py", [(21, "mlx_flash.sparse.planner"), (22, "mlx_flash.store.sizes")]),
    }
    got = violations(fake)
    expected_lines = {1, 2, 3, 7, 8, 9, 10, 11, 12, 17, 18, 21}
    assert {int(v.split(":")[1]) for v in got} == expected_lines, "\n".join(got)
    assert any(v.startswith("engine.py:10: imports mlx_flash.calibrate.routes (rule: the per-token path") for v in got)
    assert any(v.startswith("chat.py:12: imports mlx_flash.calibrate (rule: calibrate/ is imported") for v in got)
    assert any(
        v.startswith("memory/a.py:17: imports mlx_flash.bench.cgroup (rule: no runtime package imports bench/")
        for v in got
    )


def test_relative_and_nested_imports_are_resolved(tmp_path):
    root = tmp_path / "mlx_flash"
    (root / "store").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "store" / "__init__.py").write_text("from ..calibrate import moefy\n")
    (root / "store" / "a.py").write_text(
        "from . import b\nfrom .. import moe\n\n\ndef f():\n    import torch\n    from ...outside import x\n"
    )
    imports = import_map(str(root))
    assert "mlx_flash.calibrate" in {n for _, n in imports["mlx_flash.store"][1]}
    names = {n for _, n in imports["mlx_flash.store.a"][1]}
    assert {"mlx_flash.store.b", "mlx_flash.moe", "torch"} <= names
    bad = violations(imports)
    init, a = str(root / "store" / "__init__.py"), str(root / "store" / "a.py")
    assert bad == sorted(
        [
            f"{init}:1: imports mlx_flash.calibrate (rule: {RULES[0].name})",
            f"{init}:1: imports mlx_flash.calibrate (rule: {RULES[4].name})",
            f"{init}:1: imports mlx_flash.calibrate (rule: {RULES[-1].name})",
            f"{a}:2: imports mlx_flash.moe (rule: {RULES[0].name})",
            f"{a}:6: imports torch (rule: {RULES[0].name})",
        ]
    ), bad


def test_importing_the_package_loads_no_offline_code():
    code = "import sys, mlx_flash; print(sorted(m for m in sys.modules if m.startswith('mlx_flash.calibrate')))"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=os.path.dirname(PACKAGE_DIR)
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_no_module_is_over_400_lines():
    """Small files with names that explain themselves: a module of the package or a tool past 400 lines
    is split."""
    long = []
    tools = os.path.join(os.path.dirname(PACKAGE_DIR), "tools")
    for root, _, files in [*os.walk(PACKAGE_DIR), *os.walk(tools)]:
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as fh:
                    n = sum(1 for _ in fh)
                if n > 400:
                    long.append(f"{os.path.relpath(path, PACKAGE_DIR)}: {n} lines")
    assert not long, "modules over 400 lines:\n" + "\n".join(long)


def module_graph(imports: dict) -> dict[str, set[str]]:
    """module -> the package's modules it imports (each import names the module it reaches; a
    package's __init__ counts only where it is named)."""
    return {m: {n for _, n in imported if n in imports and n != m} for m, (_, imported) in imports.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def test_no_circle_among_the_package_files():
    found = circles(module_graph(import_map(PACKAGE_DIR)))
    assert not found, "import circles: " + "; ".join(" <-> ".join(g) for g in found)


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def package_graph(imports: dict) -> dict[str, set[str]]:
    """package -> the packages it imports: a subpackage (mlx_flash.offload) or a top-level module
    (mlx_flash.engine) is one node; the package root mlx_flash itself is left out (it re-exports). A
    package's `__main__` (`python -m mlx_flash.convert`) is a node of its own: an entry point that nothing
    imports, handing over to its command in cli/, so it ties no package to another."""

    def node(name):
        parts = name.split(".")
        if parts[-1] == "__main__":
            return name
        return ".".join(parts[:2]) if len(parts) > 1 else None

    graph: dict[str, set[str]] = {}
    for m, (_, imported) in imports.items():
        a = node(m)
        if a is None:
            continue
        graph.setdefault(a, set())
        graph[a] |= {b for _, n in imported if n.startswith("mlx_flash.") and (b := node(n)) not in (None, a)}
    return graph


def test_no_two_packages_import_each_other():
    """The packages form layers (docs/architecture.md), counting every import wherever it stands: a
    package that imports one above it, even through others and even inside a function, loads half the
    engine with it and breaks the moment the order changes. At import time (module level) too."""
    for module_level in (False, True):
        graph = package_graph(
            {
                **import_map(PACKAGE_DIR, module_level=module_level),
                **import_map(KERNELS_DIR, "mlx_flash.", module_level=module_level),
            }
        )
        assert {"mlx_flash.offload", "mlx_flash.service", "mlx_flash.backends", "mlx_flash.kernels"} <= set(graph)
        found = circles(graph)
        assert not found, "packages importing each other: " + "; ".join(" <-> ".join(g) for g in found)
    assert circles(
        package_graph(
            {"mlx_flash.a.x": ("x.py", [(1, "mlx_flash.b.y")]), "mlx_flash.b.y": ("y.py", [(1, "mlx_flash.a")])}
        )
    ) == [["mlx_flash.a", "mlx_flash.b"]]
    # an entry point importing the command that imports its package: no circle (nothing imports __main__)
    assert (
        circles(
            package_graph(
                {
                    "mlx_flash.a.__main__": ("m.py", [(1, "mlx_flash.cli.a")]),
                    "mlx_flash.cli.a": ("a.py", [(1, "mlx_flash.a.x")]),
                    "mlx_flash.a.x": ("x.py", []),
                }
            )
        )
        == []
    )


ENTRY_MODULES = tuple(
    f"mlx_flash.{m}"
    for m in (
        "chat",
        "serve",
        "batch",
        "verify",
        "profile_disk",
        "stores",
        "sparsify",
        "convert.__main__",
        "bench.__main__",
    )
)


def documented_levels(path: str) -> dict[str, int]:
    """node -> level, from the table of docs/architecture.md's "What may import what" (a row: | level |
    `names` | ...; `x.py` and `x/` name mlx_flash.x; "the leaves" and "the entry modules" name those)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    table = text[text.index("| level | packages and modules |") :]
    levels = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = line.split("|")
        level, names = int(cells[1]), cells[2]
        nodes = [f"mlx_flash.{n.rstrip('/').removesuffix('.py')}" for n in re.findall(r"`([a-z_]+(?:\.py|/))`", names)]
        nodes += LEAVES if "the leaves" in names else ()
        nodes += ENTRY_MODULES if "the entry modules" in names else ()
        levels.update(dict.fromkeys(nodes, level))
    return levels


ARCHITECTURE = os.path.join(os.path.dirname(PACKAGE_DIR), "docs", "architecture.md")
LEVELS = documented_levels(ARCHITECTURE)  # the one written order of the packages, which tests read from here
TOP = max(LEVELS.values())  # mlx_flash/__init__.py stands with the entry modules


def level_of(module: str) -> int:
    """The level of a module of mlx_flash in docs/architecture.md's table: its own row (an entry
    module), else its package's or top-level module's (mlx_flash.sparse.planner: mlx_flash.sparse)."""
    if module == "mlx_flash":
        return TOP
    return LEVELS[module] if module in LEVELS else LEVELS[".".join(module.split(".")[:2])]


def level_violations(graph: dict[str, set[str]], levels: dict[str, int]) -> list[str]:
    """Each package or module missing from the table, and each import of one at its own level or above."""
    bad = [f"{a} has no level in the table" for a in sorted(graph) if a not in levels]
    bad += [
        f"{a} (level {levels[a]}) imports {b} (level {levels[b]})"
        for a in sorted(graph)
        if a in levels
        for b in sorted(graph[a])
        if b in levels and levels[b] >= levels[a]
    ]
    return bad


def test_the_documented_levels_hold():
    """The package order is written down once, in docs/architecture.md's table, and this reads it: every
    package and top-level module has a level, and each imports (at module level) only lower ones."""
    levels = LEVELS
    assert levels["mlx_flash.errors"] == 0 and "mlx_flash.batching" in levels
    graph = package_graph(
        {**import_map(PACKAGE_DIR, module_level=True), **import_map(KERNELS_DIR, "mlx_flash.", module_level=True)}
    )
    bad = level_violations(graph, levels)
    assert not bad, "docs/architecture.md's levels do not hold:\n" + "\n".join(bad)
    assert level_violations(
        {"mlx_flash.a": {"mlx_flash.b"}, "mlx_flash.c": set()}, {"mlx_flash.a": 1, "mlx_flash.b": 1}
    ) == ["mlx_flash.c has no level in the table", "mlx_flash.a (level 1) imports mlx_flash.b (level 1)"]


def test_module_level_imports_leave_out_those_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import os\ntry:\n    import json\nexcept ImportError:\n    pass\n"
        "def f():\n    import sys\nclass C:\n    import re\n"
    )
    assert sorted(n for _, n in imports_of(str(f), "m", False, module_level=True)) == ["json", "os", "re"]
    assert sorted(n for _, n in imports_of(str(f), "m", False)) == ["json", "os", "re", "sys"]


def deferred_imports(root: str, prefix: str = "") -> list[tuple[str, int, str]]:
    """(file, line, module) of each import of the package's own modules that runs inside a function."""
    everywhere, at_import = import_map(root, prefix), import_map(root, prefix, module_level=True)
    out = set()
    for module, (path, imported) in everywhere.items():
        early = set(at_import[module][1])
        out |= {
            (path, line, name) for line, name in imported if (line, name) not in early and within(name, ("mlx_flash",))
        }
    return sorted({(p, line, min(n for q, ln, n in out if q == p and ln == line)) for p, line, _ in out})


def test_imports_inside_functions_are_few_and_say_why():
    """An import inside a function hides a dependency from the reader and from this test's circle
    check: it is kept only where it defers something heavy or optional (offline code, the LP solver,
    a GPU build) or where a knot is still open, and it says which on its line ("# deferred: ...")."""
    found = deferred_imports(PACKAGE_DIR) + deferred_imports(KERNELS_DIR, "mlx_flash.")
    assert len(found) <= 10, f"{len(found)} imports inside functions (at most 10): " + ", ".join(
        f"{os.path.relpath(p, PACKAGE_DIR)}:{line}" for p, line, _ in found
    )
    silent = []
    for path, line, name in found:
        with open(path, encoding="utf-8") as fh:
            text = fh.read().split("\n")[line - 1]
        if "# deferred:" not in text:
            silent.append(f"{os.path.relpath(path, PACKAGE_DIR)}:{line} ({name})")
    assert not silent, "imports inside functions without their reason (# deferred: ...): " + ", ".join(silent)
