"""Which chunks leave memory first: the LCTRU queue (LLMS §3.4).

The paper's queue is a concatenation of sub-queues, one per compression ratio, heaviest (least
compressed, least compression-tolerable) first, each ordered by the last access of its chunks'
context. With compression off (the default) every chunk weighs the same and the queue is least
recently used contexts first. Within a context the leading chunks go first: those are the cheapest
to recompute when it comes back (restore.py recomputes the leading missing chunks while reading
the rest). Contexts with a call running are never in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Iterator


class Evict(Enum):
    CHUNKS = "chunks"  # chunk by chunk in LCTRU order, written to flash first (LLMS)
    WHOLE_CONTEXT = "whole-context"  # every chunk of the least recently used context at once
    DROP = "drop"  # discarded, recomputed from the tokens when needed (a low-memory killer, LMK)


class Restore(Enum):
    PIPELINE = "pipeline"  # read and recompute at once (LLMS §3.3)
    READ = "read"  # read only
    RECOMPUTE = "recompute"  # recompute only


@dataclass(frozen=True)
class Lifecycle:
    """How chunks leave memory and come back. The default is LLMS; the other values are the
    baselines and ablations `python -m mlx_flash.bench service` measures it against."""

    evict: Evict = Evict.CHUNKS
    restore: Restore = Restore.PIPELINE
    ahead: bool = True  # ahead-of-time swap-out in idle time (swap_out_idle does nothing when False)


def eviction_order(contexts: Iterable) -> Iterator[tuple]:
    """(context, chunk index) of every in-memory chunk of every idle context, first to leave first:
    contexts least recently used first; with compression, the heavier (wider) chunks of a context
    before its lighter ones, then the leading chunks first."""
    for ctx in sorted((c for c in contexts if not c.pinned), key=lambda c: c.last_used):
        for i in sorted(ctx.chunks_in_memory(), key=lambda i: (-_weight(ctx, i), i)):
            yield ctx, i


def _weight(ctx, i: int) -> int:
    w = ctx.widths[i] if i < len(ctx.widths) else 0
    return w or 32
