"""Memory amounts as users write them: a share of some total ("50%") or bytes ("300MB", "1.5GiB")."""

from __future__ import annotations

import re

from .errors import ConfigError
from .units import fmt

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(value, total: int) -> int:
    """'50%' -> half of total; 300000000, '300MB', '1.5GiB' -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[kKmMgG]?i?[bB]?)\s*", str(value))
        if not m:
            raise ConfigError(f"memory budget {value!r} is not understood (use e.g. 50%, 300MB or 1.5GiB)")
        num, unit = float(m.group(1)), m.group(2)
        n = int(total * num / 100) if unit == "%" else int(num * _UNITS[unit.lower()])
    if n <= 0:
        raise ConfigError(f"memory budget {value!r} must be positive")
    return n


def weights_budget(value, model_bytes: int, cap: int) -> int:
    """The weights' share of the memory limit: `cap` (what the limit leaves them) unless the user gave
    `value` (a share of the fully resident model's `model_bytes`, or bytes), which may not exceed it."""
    if value is None:
        return cap
    n = parse_budget(value, model_bytes)
    if n > cap:
        raise ConfigError(f"weights budget {value} ({fmt(n)}) is more than the memory budget leaves for weights "
                          f"({fmt(cap)}); raise the memory budget or lower the weights budget")
    return n
