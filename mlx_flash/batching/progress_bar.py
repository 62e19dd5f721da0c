"""A batch run's progress on stderr: sequences done and tokens per second, as the throughput mode and a
pipeline's batches show it."""

from __future__ import annotations

import sys
import time


def say(bar, line: str) -> None:
    """A line on stderr, above the progress bar when there is one."""
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr)


def progress_bar(total: int, enabled: bool):
    """A bar over `total` sequences that also counts tokens (None when not enabled)."""
    if not enabled:
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="seq", desc="sequences", file=sys.stderr)
    bar.tokens = 0
    return bar


def tick(bar, n: int, t0: float) -> None:
    """`n` more tokens made since `t0`: the bar shows the run's tokens per second."""
    bar.tokens += n
    bar.set_postfix_str(f"{bar.tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s", refresh=False)
    bar.refresh()


def chain_done(on_done, bar):
    """The caller's on_done(sequence), with the bar advanced first; None when neither is there."""
    if on_done is None and bar is None:
        return None

    def done(seq):
        if bar is not None:
            bar.update(1)
        if on_done is not None:
            on_done(seq)

    return done
