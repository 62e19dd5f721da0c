"""Feedback on the waits a user sits through (conversion, the first-use disk probe, checksums):
a named step on stderr with how long it took, and byte bars through tqdm. Silent when disabled, so
library callers and tests pass progress=False and see nothing."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


@contextmanager
def step(what: str, enabled: bool = True, detail: str = ""):
    """Print "what (detail) ..." when the step starts and "what: done in 1.2 s" (or "failed") when it
    ends."""
    if not enabled:
        yield
        return
    print(f"{what} ({detail}) ..." if detail else f"{what} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(f"{what}: failed after {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        raise
    print(f"{what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def byte_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar counting bytes (B, kB, MB...)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled, file=sys.stderr)
