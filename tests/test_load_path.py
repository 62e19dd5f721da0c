"""The chat's start, followed call by call: from mlx_flash.cli.chat:main to the first generated token,
the load path runs one way (name -> locate -> store -> memory plan -> engine). Every Python call from
one module of mlx_flash into another is recorded (sys.setprofile) and both ends are placed by the
levels of docs/architecture.md's table (test_layering.LEVELS); a call into a module at a higher level
than its caller's ("a climb": a lower layer calling back up, through a callback handed down or a
knot between packages) is counted. Two kinds of call are not climbs, and are counted apart: a call of
a method that a base class at or below the caller's level declares (the engine asking its FFN source,
declared by mlx_flash.ffn_source:FFNSource, for its stats: the caller knows only the interface below
it), and any call the graph (models/) makes, which imports leaves only and is handed everything it
calls above itself (ops, weights, caches, the FFN source; docs/architecture.md). distributed/ runs
only for a pipeline (--pipeline)."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

import pytest
from test_layering import level_of, within

from mlx_flash.cli import chat

MAX_CLIMBS = 10


@dataclass
class Trace:
    """What one run recorded: each climb (caller -> callee, both module:function) and the functions
    of mlx_flash.distributed that ran."""

    calls: int = 0
    handed: int = 0  # calls the graph (models/) makes through what it was handed
    interface: int = 0  # calls of a method declared by a base class at or below the caller's level
    climbs: list = field(default_factory=list)
    distributed: set = field(default_factory=set)

    def profile(self, frame, event, arg):
        if event != "call" or frame.f_code.co_name == "<module>":  # imports are not calls
            return
        callee = frame.f_globals.get("__name__", "")
        if not within(callee, ("mlx_flash",)):
            return
        back = frame.f_back  # the nearest caller in mlx_flash (through the stdlib, e.g. a context manager)
        while back is not None and not within(back.f_globals.get("__name__", ""), ("mlx_flash",)):
            back = back.f_back
        if back is None:
            return
        caller = back.f_globals["__name__"]
        if caller == callee:
            return
        self.calls += 1
        if level_of(callee) > level_of(caller) and within(caller, ("mlx_flash.models",)):
            self.handed += 1
            return
        if level_of(callee) > level_of(caller) and declared_below(frame, level_of(caller)):
            self.interface += 1
            return
        if within(callee, ("mlx_flash.distributed",)):
            self.distributed.add(f"{callee}:{frame.f_code.co_name}")
        if level_of(callee) > level_of(caller):
            self.climbs.append(
                f"{caller}:{back.f_code.co_name} (level {level_of(caller)}) -> "
                f"{callee}:{frame.f_code.co_name} (level {level_of(callee)})"
            )

    def report(self) -> str:
        counted = Counter(self.climbs)
        return (
            f"{len(self.climbs)} climbs in {self.calls} calls between modules "
            f"(besides {self.interface} calls through an interface declared below the caller and "
            f"{self.handed} calls of the graph through what it was handed):\n"
        ) + "\n".join(f"  {n} x {c}" for c, n in counted.most_common())


def declared_below(frame, level: int) -> bool:
    """Whether the method running in `frame` is declared by a base class of its object's class that
    stands in mlx_flash at `level` or below."""
    obj = frame.f_locals.get("self") if frame.f_code.co_argcount else None
    if obj is None:
        return False
    name = frame.f_code.co_name
    return any(
        name in vars(cls) and within(cls.__module__, ("mlx_flash",)) and level_of(cls.__module__) <= level
        for cls in type(obj).__mro__[1:]
    )


def run_traced(argv) -> tuple[int, Trace]:
    """chat.main(argv) with every call between mlx_flash's modules recorded."""
    trace = Trace()
    sys.setprofile(trace.profile)
    try:
        status = chat.main(argv)
    finally:
        sys.setprofile(None)
    return status, trace


@pytest.mark.parametrize(
    "family, shape, flags",
    [
        ("llama", {}, []),  # resident
        (
            "llama",
            {"intermediate_size": 1024, "num_hidden_layers": 8},
            ["--weights-budget", "70%"],
        ),  # ffn auto: hybrid sparse
        ("llama", {}, ["--ffn", "stream"]),
        ("mixtral", {}, ["--weights-budget", "60%"]),  # streamed experts
    ],
    ids=["resident", "hybrid", "stream", "experts"],
)
def test_the_chat_start_runs_down_the_layers(tiny_store, tmp_path, capsys, family, shape, flags):
    """One answer of one token (the start up to the first generated token) on a tiny model: fewer
    than MAX_CLIMBS calls back up into a higher layer, and no function of distributed/ runs."""
    store, _ = tiny_store(family, **shape)
    argv = ["--model", store, "--prompt", "hello", "--raw", "--max-tokens", "1", *flags]
    status, trace = run_traced(argv + ["--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr()
    assert status == 0, out.err
    with capsys.disabled():
        print(f"\n{family} {' '.join(flags)}: " + trace.report())
    assert not trace.distributed, "distributed/ ran without --pipeline: " + ", ".join(sorted(trace.distributed))
    assert len(trace.climbs) < MAX_CLIMBS, trace.report()
