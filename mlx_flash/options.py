"""Typed options, each documented once (its `help`): `load()`, `EngineConfig` and the chat's flags
are built from these dataclasses, so an option's name, default, choices and meaning live here.

  FlashOptions   LLM in a flash: ffn="sparse" on a dense model
  ExpertOptions  EdgeMoE: experts streamed through a cache (ffn="stream"/"sparse" on a MoE model)
  IOOptions      how FFN bytes are read from flash

Enum-valued options accept their string values ("window", "lru") and are stored as the enum; every
value is checked when the options are made, never per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
import reprlib
from dataclasses import dataclass, field
from enum import Enum

from .choices import ExpertPolicy, PredictorKind, SparseKernel, SparseMode
from .errors import ConfigError


def option(default, help: str, flag: str | None = None, kind=None, factory=None):
    """A documented field: `flag` is its command-line name (default --field-name); `kind` the
    argparse type for values that are not plain (int/float/str/bool/enum) fields."""
    meta = {"help": help, "flag": flag, "kind": kind}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


class ReadMode(Enum):
    DIRECT = "direct"  # bypass the page cache (O_DIRECT / F_NOCACHE): reads cost what flash costs
    BUFFERED = "buffered"  # through the page cache


def parse_enum(cls, value, what: str):
    try:
        return cls(value.value if isinstance(value, Enum) else value)
    except ValueError:
        raise ConfigError(f"{what} {value!r} is unknown (choose one of: {', '.join(m.value for m in cls)})") from None


def _check_enums(obj) -> None:
    """Turn string values of enum fields into the enum (frozen dataclasses included), after checking
    every plain field's type (a "3" where an int goes would fail later, with a message naming nothing)."""
    _check_types(obj)
    for f in dataclasses.fields(obj):
        if isinstance(f.default, Enum):
            object.__setattr__(obj, f.name, parse_enum(type(f.default), getattr(obj, f.name), _name(f)))


def _name(f) -> str:
    return (f.metadata.get("flag") or f.name).lstrip("-").replace("-", "_")


# The plain types an annotation may name, and what each accepts: any integral or real number (numpy's
# included) but never a bool where a number goes, since True is an int to Python but not to a user.
_PLAIN = {"int": numbers.Integral, "float": numbers.Real, "str": str, "bool": bool, "None": type(None)}
_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "True or False", "None": "None"}


def _check_types(obj) -> None:
    """Each field whose annotation is made of plain types (`int | None`, `str | float`) holds one of them."""
    for f in dataclasses.fields(obj):
        kinds = [k.strip() for k in str(f.type).split("|")]  # annotations are strings (__future__ annotations)
        if not all(k in _PLAIN for k in kinds):
            continue  # an enum or an option group: checked by its own parser
        value = getattr(obj, f.name)
        if not any(_is(value, k) for k in kinds):
            raise ConfigError(f"{_name(f)} must be {' or '.join(_WORDS[k] for k in kinds)} (got {reprlib.repr(value)})")


def _is(value, kind: str) -> bool:
    if kind in ("int", "float") and isinstance(value, bool):
        return False
    return isinstance(value, _PLAIN[kind])


@dataclass(frozen=True)
class FlashOptions:
    mode: SparseMode = option(
        SparseMode.ALL,
        "sparse FFN: what is read per token (naive: whole layers; hybrid: "
        "a resident share plus the rest; predictor: the predicted rows; window: + rows of the "
        "last k tokens kept cached; all: + bundled reads)",
        flag="--sparse-mode",
    )
    window: int = option(
        0,
        "sparse FFN: tokens whose active rows stay cached (0: the planner picks it from the "
        "measured activity and the disk profile)",
    )
    predictor: PredictorKind = option(
        PredictorKind.LOWRANK,
        "sparse FFN: which neurons a token needs: lowrank "
        "(trained, in the store), gate (the resident 4-bit gate/up projection: the "
        "selection lowrank approximates), dense (every neuron: exact) or statistical "
        "(synthetic checkpoints only: a labelled statistical model draws "
        "--statistical-active of the read units per token; the output is noise)",
    )
    statistical_active: float = option(
        0.5,
        "sparse FFN with the statistical predictor: the share of read units "
        "(neurons, or blocks of them) active per token",
    )
    recall: float | None = option(
        None,
        "sparse FFN with the lowrank predictor: use its cuts calibrated for this "
        "recall (higher reads more; default: as trained)",
        flag="--predictor-recall",
        kind=float,
    )
    kernel: SparseKernel = option(
        SparseKernel.AUTO,
        "sparse FFN decode steps: auto (the backend's sparse kernel "
        "over the neuron cache: cpu, metal or cuda, where the store's layout allows) or "
        "reference (the active rows as framework weights; slower, equal up to float32 "
        "summation order)",
        flag="--sparse-kernel",
    )
    down_only: bool = option(
        False,
        "sparse FFN with the gate predictor: read only down columns, computing gate/up "
        "from its resident 4-bit copy (a third of the bytes; exact when the store's gate/up "
        "are 4-bit, otherwise an approximation)",
    )

    def __post_init__(self):
        _check_enums(self)
        if self.window < 0:
            raise ConfigError(f"window must be >= 1, or 0 for the planner's choice (got {self.window})")
        if not 0 < self.statistical_active < 1:
            raise ConfigError(f"statistical active share must be in (0, 1) (got {self.statistical_active})")
        if self.recall is not None and not 0 < self.recall <= 1:
            raise ConfigError(f"predictor recall must be in (0, 1] (got {self.recall})")
        if self.down_only and (self.predictor is not PredictorKind.GATE or not self.mode.needs_predictor):
            raise ConfigError(
                "down-only reads need the gate predictor (its resident gate/up copy computes the "
                "activations) and a predictor mode (predictor, window or all)"
            )


@dataclass(frozen=True)
class ExpertOptions:
    policy: ExpertPolicy = option(
        ExpertPolicy.EDGEMOE, "MoE with streamed experts: expert-cache eviction policy", flag="--expert-policy"
    )
    # Off by default: on the derived MoE model decoded teacher-forced on two cores, every policy ran
    # slower with the preloader than without (docs/earlier-results/experts.md): its reads and conversions
    # take the cores the products need, and a third of its guesses are wrong.
    preload: int = option(
        0,
        "MoE with streamed experts: next-layer experts read ahead per decode step from the "
        "store's routing predictor (tools/trace_experts.py); -1: as many as a token routes to "
        "when the store has one, 0: off (the default)",
        flag="--expert-preload",
    )

    def __post_init__(self):
        _check_enums(self)
        if self.preload < -1:
            raise ConfigError(f"expert preload must be >= 0, or -1 for a token's routed count (got {self.preload})")


@dataclass(frozen=True)
class IOOptions:
    mode: ReadMode = option(
        ReadMode.DIRECT,
        "how streamed FFN bytes are read: direct (bypassing the page cache) or buffered",
        flag="--io-mode",
    )
    threads: int | None = option(
        None,
        "reader threads, 1-256 (default: the best count for the read size, from the disk profile)",
        flag="--io-threads",
        kind=int,
    )

    def __post_init__(self):
        _check_enums(self)
        check_threads("io threads", self.threads)


# More threads than this is a typo, not a tuning: starting them fails ("can't start new thread") long
# after the options were taken, or the machine thrashes.
MAX_THREADS = 256


def check_threads(what: str, n: int | None) -> None:
    if n is not None and not 1 <= n <= MAX_THREADS:
        raise ConfigError(f"{what} must be in 1-{MAX_THREADS} (got {n})")


# ---- command lines -------------------------------------------------------------------------------
def _flag(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _dest(cls, f) -> str:
    """Where argparse keeps a field: qualified, so that two groups may both have a `mode`."""
    return f"{cls.__name__}.{f.name}"


def add_arguments(parser: argparse.ArgumentParser, cls, skip: tuple = ()) -> None:
    """One flag per documented field of `cls`, nested option groups included (their flags are flat)."""
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        if dataclasses.is_dataclass(f.metadata.get("kind")):
            add_arguments(parser, f.metadata["kind"], skip)
            continue
        kw = {"dest": _dest(cls, f), "help": f.metadata["help"]}
        default = f.default
        if isinstance(default, Enum):
            kw.update(choices=[m.value for m in type(default)], default=default.value)
        elif isinstance(default, bool):
            # on by default: --no-<flag> turns it off
            kw.update(action=argparse.BooleanOptionalAction if default else "store_true", default=default)
        else:
            kw.update(default=default, type=f.metadata.get("kind") or type(default), metavar=f.name.upper())
        if isinstance(default, (int, float, str)) and not isinstance(default, bool) and default != "":
            kw["help"] += f" (default: {default})"
        kw["help"] = kw["help"].replace("%", "%%")  # argparse formats help with %
        parser.add_argument(_flag(f), **kw)


def from_arguments(cls, ns: argparse.Namespace):
    """`cls` built from what `add_arguments(parser, cls)` parsed."""
    kw = {}
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        if dataclasses.is_dataclass(f.metadata.get("kind")):
            kw[f.name] = from_arguments(f.metadata["kind"], ns)
            continue
        if _dest(cls, f) in vars(ns):
            kw[f.name] = vars(ns)[_dest(cls, f)]
    return cls(**kw)
