"""Which chunks leave memory first: the LCTRU queue (LLMS §3.4).

The paper's queue is a concatenation of sub-queues, one per compression ratio, heaviest (least
compressed, least compression-tolerable) first, each ordered by the last access of its chunks'
context. With compression off (the default) every chunk weighs the same and the queue is least
recently used contexts first. Within a context the leading chunks go first: those are the cheapest
to recompute when it comes back (restore.py recomputes the leading missing chunks while reading
the rest). Contexts with a call running are never in the queue.
"""

from __future__ import annotations

from typing import Iterable, Iterator


def eviction_order(contexts: Iterable) -> Iterator[tuple]:
    """(context, chunk index) of every in-memory chunk of every idle context, first to leave first."""
    for ctx in sorted((c for c in contexts if not c.pinned), key=lambda c: c.last_used):
        for i in ctx.chunks_in_memory():
            yield ctx, i
