"""The one number a user gives for memory: a share of the model's bytes or an amount of bytes."""

from __future__ import annotations

import re

from .errors import ConfigError

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
