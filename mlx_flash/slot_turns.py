"""Turns of a streamed buffer between the reader that refills it and a lazy graph that reads it.

On an eager backend (torch) a product runs when it is called, so a layer's reads of its slot are done
before the next layer is asked for and a reader may refill the slot then (layer_stream.py, the FFN
reader). On a lazy one (MLX) a token's whole forward is built first and evaluated once: the reads
must wait inside the graph. Each use of a slot is a claim with a number (`seq`, rising by one per
claim of this set of slots); a feeder thread reads the claim's bytes into its slot once every earlier
user of that slot is done (the `release` fence reaches the slot's previous claim), then raises the
`ready` fence to the claim's number. The graph's kernels take the slot through an await node
(kernels/mlx_kernels.py) that waits for `ready` and, since it runs after the layer's input (so after
every kernel of the layers before it), first raises `release` to the claim before. Both fences are
the backend's (MLX: C++ counters the graph can wait on); nothing here touches a framework array.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass


class SlotTurns:
    """Claims on a set of slots, served in order by one feeder thread."""

    def __init__(self, ready, release, name: str = "mlx-flash-turns"):
        self.ready, self.release = ready, release
        self.seq = 0
        self.current: dict[int, int] = {}  # slot -> its latest claim
        self.error: BaseException | None = None
        self.bytes_read = self.reads = 0
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def claim(self, slot: int, read) -> int:
        """A new use of `slot`: `read()` (blocking; returns a reader-pool batch, or None when nothing
        needs reading) runs once the slot's previous use is done. Returns the claim's number."""
        self.seq += 1
        prev = self.current.get(slot, 0)
        self.current[slot] = self.seq
        self._jobs.put((self.seq, prev, read))
        return self.seq

    def gate(self, slot: int) -> "SlotGate":
        """What the graph's await nodes take for `slot`: its fences and its latest claim."""
        return SlotGate(self, slot)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            seq, prev, read = job
            if not self.release.wait(prev):  # cancelled: closing
                return
            try:
                batch = read()
                if batch is not None:
                    self.bytes_read += batch.bytes_read
                    self.reads += batch.reads
            except BaseException as e:  # said after the graph ran (settle); the graph must not hang
                self.error = self.error or e
            self.ready.signal(seq)

    @property
    def wait_seconds(self) -> float:
        """Time the graph spent blocked on reads."""
        return self.ready.blocked_seconds

    def settle(self) -> None:
        """The graph built so far has run (the backend evaluated it): every claim is done with, and a
        read that failed meanwhile is raised here."""
        self.release.signal(self.seq)
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def close(self) -> None:
        """Stop the feeder; waiters wake (reads in flight finish writing first)."""
        self._jobs.put(None)
        self.release.cancel()
        self.ready.cancel()
        self._thread.join()


@dataclass(frozen=True)
class SlotGate:
    turns: SlotTurns
    slot: int

    @property
    def seq(self) -> int:
        return self.turns.current.get(self.slot, 0)
