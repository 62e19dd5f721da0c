"""Memory amounts as users write them: a share of some total ("50%") or bytes ("300MB", "1.5GiB")."""

from __future__ import annotations

import math
import re

from .errors import ConfigError, MemoryBudgetError
from .units import fmt, fmt_apart

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
FORMS = "a share like 50%, or bytes like 300000000, 300MB or 1.5GiB"


def parse_budget(value, total: int, what: str = "memory budget") -> int:
    """'50%' -> half of total; 300000000, '300MB', '1.5GiB' -> bytes. `what` names the option in errors."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{what} {value!r} is not a finite number (use {FORMS})")
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[kKmMgG]?i?[bB]?)\s*", str(value))
        if not m:
            raise ConfigError(f"{what} {value!r} is not understood (use {FORMS})")
        num, unit = float(m.group(1)), m.group(2)
        n = int(total * num / 100) if unit == "%" else int(num * _UNITS[unit.lower()])
    if n <= 0:
        # Say what the value was read as: '0.5' meant as a share reads as half a byte.
        raise ConfigError(
            f"{what} {value!r} is {n} bytes, and must be at least 1 byte (a number without a unit "
            f"is bytes; use {FORMS})"
        )
    return n


def weights_budget(value, model_bytes: int, cap: int, minimum: int = 0) -> int:
    """The weights' share of the memory limit: `cap` (what the limit leaves them) unless the user gave
    `value` (a share of the fully resident model's `model_bytes`, or bytes), which may not exceed it
    nor fall below `minimum` (the least the weights can be held in, whatever the FFN mode)."""
    if value is None:
        return cap
    n = parse_budget(value, model_bytes, "weights budget")
    if n > cap:
        raise ConfigError(
            f"weights budget {value} ({fmt(n)}) is more than the memory budget leaves for weights "
            f"({fmt(cap)}); raise the memory budget or lower the weights budget"
        )
    if n < minimum:
        low, need = fmt_apart(n, minimum)
        raise MemoryBudgetError(
            f"weights budget {value} ({low}) is below the {need} this model's weights need at "
            f"the least (resident tensors, two layers' buffers and one FFN layer's reads)"
        )
    return n
