"""The one number a user gives for memory (`memory_budget`): the cap on the whole process's peak
RSS, as "auto" (all the memory available to the process less SAFETY_MARGIN), a percentage of that
available memory ("60%"), or bytes ("1.5GB", "2GiB", 2000000000)."""

from __future__ import annotations

from dataclasses import dataclass

from ..budget import parse_budget
from ..errors import ConfigError
from ..units import fmt
from .available import Available, available_memory

# "auto" leaves this share of the available memory (at least SAFETY_MIN) to the rest of the system
# and to what the plan cannot see coming (allocator fragmentation, the kernel's own page tables).
SAFETY_MARGIN = 0.05
SAFETY_MIN = 64 << 20


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    how: str  # what the user's value meant, for the plan line


def resolve_limit(value, available: Available | None = None) -> MemoryLimit:
    avail = available or available_memory()
    if isinstance(value, str) and value.strip().lower() == "auto":
        margin = max(int(avail.bytes * SAFETY_MARGIN), SAFETY_MIN)
        n = avail.bytes - margin
        if n <= 0:
            raise ConfigError(f"memory budget auto: only {fmt(avail.bytes)} available ({avail.source})")
        return MemoryLimit(n, f"auto: {avail.source} {fmt(avail.bytes)} less {fmt(margin)}")
    n = parse_budget(value, avail.bytes)
    if isinstance(value, str) and value.strip().endswith("%"):
        return MemoryLimit(n, f"{value.strip()} of {avail.source} {fmt(avail.bytes)}")
    if n > avail.bytes:
        raise ConfigError(
            f"memory budget {fmt(n)} is more than this process may use ({fmt(avail.bytes)}, "
            f"{avail.source}); an engine planned for it would be OOM-killed"
        )
    return MemoryLimit(n, "given")
