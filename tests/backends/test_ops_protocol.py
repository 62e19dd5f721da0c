"""Both backends implement the declared op set (mlx_flash/backends/ops.py), and the declaration cannot
drift from use: every member of `Ops` exists on `MLXOps` and `TorchOps` with the same parameters
(names, kinds, defaults; no backend adds any), `LazyOps` on `MLXOps`, and every `ops.<name>` the
package uses (found with ast, the same scan whatever the receiver is called: `ops`, `self.ops`,
`engine.ops`, `gate_ops`, ...) is declared. The members both backends share are declared too."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import textwrap

import pytest

from mlx_flash.backends import get_backend
from mlx_flash.backends.ops import LazyOps, Ops

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "mlx_flash")
BACKENDS_DIR = os.path.join(PACKAGE_DIR, "backends")
BACKENDS = {"mlx": ("mlx.core", "MLXOps"), "torch": ("torch", "TorchOps")}  # name -> (framework, class)


def backend_class(name: str):
    """The backend's ops class, the test skipped (with the reason) where its framework is missing."""
    framework, cls = BACKENDS[name]
    pytest.importorskip(framework, reason=f"the {name} backend needs {framework}, which is not installed here")
    return getattr(importlib.import_module(f"mlx_flash.backends.{name}"), cls)


def declared(proto) -> dict[str, str]:
    """name -> "method", "property" or "attribute" for every member a protocol of ops.py declares
    (its own and its protocol bases')."""
    out = {}
    for klass in reversed(proto.__mro__):
        if klass.__module__ != Ops.__module__:
            continue  # typing.Protocol, Generic, object
        out.update({n: "attribute" for n in klass.__dict__.get("__annotations__", {})})
        out.update(
            {
                n: "property" if isinstance(v, property) else "method" if callable(v) else "attribute"
                for n, v in klass.__dict__.items()
                if not n.startswith("_")
            }
        )
    return out


def instance_attributes(cls) -> set[str]:
    """Names a class's methods assign on self (`self.x = ...`, also in tuples): its instance attributes."""
    names = set()
    for klass in cls.__mro__[:-1]:
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        names.add(e.attr)
    return names


def public_members(cls) -> set[str]:
    return {n for n in set(dir(cls)) | instance_attributes(cls) if not n.startswith("_")}


def parameters(cls, name: str) -> list[tuple]:
    """(name, kind, default) of each parameter of method `name` as called on an instance (no self)."""
    raw = inspect.getattr_static(cls, name)
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    params = list(inspect.signature(fn).parameters.values())
    if not isinstance(raw, staticmethod):
        params = params[1:]
    return [(p.name, p.kind.name, p.default) for p in params]


def shown(params: list[tuple]) -> str:
    """parameters() as a signature reads: (x, approximate=False)."""
    marks = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}
    return (
        "("
        + ", ".join(marks.get(k, "") + n + ("" if d is inspect.Parameter.empty else f"={d!r}") for n, k, d in params)
        + ")"
    )


def mismatches(cls, proto) -> list[str]:
    """What `cls` lacks of `proto`, or has in another form (a method's parameters, a data member as a method)."""
    bad, attrs = [], instance_attributes(cls)
    for name, kind in sorted(declared(proto).items()):
        if not hasattr(cls, name) and name not in attrs:
            bad.append(f"{cls.__name__} lacks {name}")
            continue
        raw = inspect.getattr_static(cls, name, None)
        is_method = isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw)
        if kind == "method" and not is_method:
            bad.append(f"{cls.__name__}.{name} is not a method")
        elif kind != "method" and is_method:
            bad.append(f"{cls.__name__}.{name} is a method; the protocol declares a {kind}")
        elif kind == "method" and parameters(cls, name) != parameters(proto, name):
            bad.append(
                f"{cls.__name__}.{name}{shown(parameters(cls, name))} != "
                f"protocol's {name}{shown(parameters(proto, name))}"
            )
    return bad


# ---- the scan of the package for ops.<name> -------------------------------------------------------
def is_receiver(node, imported: set[str]) -> bool:
    """`ops`, `x_ops` (not a module imported under that name), or `<anything>.ops` / `.x_ops`."""
    if isinstance(node, ast.Name):
        return (node.id == "ops" or node.id.endswith("_ops")) and node.id not in imported
    return isinstance(node, ast.Attribute) and (node.attr == "ops" or node.attr.endswith("_ops"))


def uses_in(source: str, where: str) -> dict[str, list[str]]:
    """name -> ["where:line", ...] for each `<ops receiver>.name` and `getattr/hasattr(<receiver>, "name")`."""
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_receiver(node.value, imported):
            out.setdefault(node.attr, []).append(f"{where}:{node.lineno}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and is_receiver(node.args[0], imported)
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            out.setdefault(node.args[1].value, []).append(f"{where}:{node.lineno}")
    return out


def package_uses(root: str = PACKAGE_DIR) -> dict[str, list[str]]:
    """Every ops.<name> the package outside backends/ uses, with where."""
    out: dict[str, list[str]] = {}
    for d, _, files in os.walk(root):
        if os.path.commonpath([d, BACKENDS_DIR]) == BACKENDS_DIR:
            continue
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8") as fh:
                    found = uses_in(fh.read(), os.path.relpath(path, os.path.dirname(root)))
                for name, where in found.items():
                    out.setdefault(name, []).extend(where)
    return {name: sorted(set(where)) for name, where in out.items()}


# ---- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_backend_implements_the_op_set(name):
    cls = backend_class(name)
    bad = mismatches(cls, Ops)
    assert not bad, f"{cls.__name__} does not implement backends.ops.Ops:\n" + "\n".join(bad)


def test_the_mlx_backend_implements_the_lazy_members():
    cls = backend_class("mlx")
    bad = mismatches(cls, LazyOps)
    assert not bad, "MLXOps does not implement backends.ops.LazyOps:\n" + "\n".join(bad)


def test_the_torch_backend_is_eager_so_needs_no_lazy_members():
    """The callers ask for LazyOps' members only where ops.lazy is true; torch never is."""
    assert backend_class("torch").lazy is False


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_backend_instance_is_an_ops(name):
    """The runtime check (typing.runtime_checkable) on real instances: instance attributes included."""
    backend_class(name)
    ops = get_backend(name)
    assert isinstance(ops, Ops)
    assert isinstance(ops, LazyOps) == (name == "mlx")


def test_every_op_the_package_uses_is_declared():
    uses = package_uses()
    assert len(uses) >= 40 and {"linear", "sdpa", "rope", "to_numpy", "held_bytes", "slot_turns"} <= set(uses), (
        f"the scan found too little: {sorted(uses)}"
    )
    undeclared = {n: w for n, w in uses.items() if n not in declared(LazyOps)}
    assert not undeclared, "ops members used but not declared in backends/ops.py: " + "; ".join(
        f"{n} ({', '.join(w[:3])})" for n, w in sorted(undeclared.items())
    )


def test_what_both_backends_share_is_declared():
    shared = public_members(backend_class("mlx")) & public_members(backend_class("torch"))
    missing = sorted(shared - set(declared(Ops)))
    assert not missing, f"both backends define {missing}, which backends/ops.py does not declare"


def test_the_checks_can_fail():
    source = (
        "from ..kernels import torch_ops\n"
        "def f(ops, engine, gate_ops, w):\n"
        "    ops.linear(w); engine.ops.to_numpy(w); gate_ops.held_bytes(w); self.ops.array(w)\n"
        "    getattr(ops, 'lazy'); w.rope(w); torch_ops.ops()\n"
    )
    assert set(uses_in(source, "x.py")) == {"linear", "to_numpy", "held_bytes", "array", "lazy"}
    assert uses_in(source, "x.py")["linear"] == ["x.py:3"]

    class Short:
        name = "short"

        def linear(self, x):  # w missing
            return x

        @staticmethod
        def rms_norm(x, weight, eps=1e-5):  # a default the protocol has not
            return x

        def lazy(self):  # a method where a property is declared
            return False

    bad = mismatches(Short, Ops)
    assert "Short lacks sdpa" in bad and "Short lacks act_dtype" in bad and "Short lacks name" not in bad
    assert "Short.linear(x) != protocol's linear(x, w)" in bad
    assert "Short.rms_norm(x, weight, eps=1e-05) != protocol's rms_norm(x, weight, eps)" in bad
    assert "Short.lazy is a method; the protocol declares a property" in bad
    assert {"slot_turns", "host_syncs", "linear", "name", "lazy"} <= set(declared(LazyOps))
    assert "slot_turns" not in declared(Ops)
