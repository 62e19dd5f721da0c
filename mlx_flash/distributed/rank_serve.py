"""A rank other than 0: receive each message from the rank before, run this rank's layers on it, send
it on (the protocol of pipeline.py), until rank 0 says STOP or a neighbour is lost."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .pipeline import (
    FAULT,
    FORWARD,
    FREE,
    GROUP,
    HEADER,
    MAX_SEQS,
    NEW_SEQ,
    STOP,
    TRIM,
    joined_rows,
    rows_caches,
    run_group,
    run_layers,
    split_rows,
)
from .transport import Outbox, PeerLostError, Transport


@dataclass
class StageProfile:
    """Where a rank other than 0 spent its time serving: `busy_s` running its layers (of which
    `io_s` blocked on reads), `waiting_s` for the next message; `bytes_read` from flash."""

    rank: int
    steps: int = 0
    busy_s: float = 0.0
    io_s: float = 0.0
    waiting_s: float = 0.0
    bytes_read: int = 0

    def line(self) -> str:
        n = max(1, self.steps)
        return (
            f"pipeline stage: rank {self.rank} ran {self.steps} steps: per step {self.busy_s / n * 1e3:.1f} ms busy "
            f"(io wait {self.io_s / n * 1e3:.1f} ms, read {self.bytes_read / n / 1e6:.1f} MB), "
            f"{self.waiting_s / n * 1e3:.1f} ms waiting for the next"
        )


def serve(engine, transport: Transport, stages: list[range], profile: StageProfile | None = None) -> int:
    """A rank other than 0: run this rank's layers on every FORWARD until STOP. Returns the exit
    status (0 after STOP; 1 when the upstream neighbour was lost, after telling rank 0 which).
    `profile`, when given, counts where the time went."""
    r, size = transport.rank, transport.size
    prev, nxt = r - 1, (r + 1) % size
    mine = range(len(stages[r]))  # the engine holds this rank's stage alone, its layers numbered from 0
    seqs: OrderedDict[int, list] = OrderedDict()
    outbox = Outbox(transport)
    prof = profile or StageProfile(r)
    try:
        while True:
            t0 = time.perf_counter()
            try:
                header = transport.recv((HEADER,), np.int32, prev)
                cmd, seq, B, T = (int(v) for v in header[:4])
                if cmd == FORWARD:
                    ids = transport.recv((B,), np.int32, prev)
                    payload = transport.recv((B, T, engine.args.hidden_size), np.float32, prev)
                elif cmd == GROUP:  # (T: the group's tokens together)
                    ids = transport.recv((B,), np.int32, prev)
                    lengths = transport.recv((B,), np.int32, prev)
                    payload = transport.recv((T, engine.args.hidden_size), np.float32, prev)
            except PeerLostError:
                _tell_downstream(outbox, nxt, prev)
                return 1
            out = [header]
            if cmd in (FORWARD, GROUP):
                t1 = time.perf_counter()
                io0, _, read0, _ = engine.io_counters()
                rows = []
                for i in ids.tolist():
                    if i not in seqs:
                        seqs[i] = engine.new_caches()
                    seqs.move_to_end(i)
                    rows.append(seqs[i])
                if cmd == FORWARD:
                    out += [ids, run_layers(engine, mine, payload, rows_caches(rows))]
                else:
                    hs = run_group(engine, mine, split_rows(engine.ops, payload, lengths), rows)
                    out += [ids, lengths, joined_rows(engine.ops, hs)]
                io1, _, read1, _ = engine.io_counters()
                t2 = time.perf_counter()
                prof.steps += 1
                prof.waiting_s += t1 - t0
                prof.busy_s += t2 - t1
                prof.io_s += io1 - io0
                prof.bytes_read += read1 - read0
            elif cmd == NEW_SEQ:
                seqs[seq] = engine.new_caches(T)  # (T: the tokens the sequence may hold)
            elif cmd == FREE:
                seqs.pop(seq, None)
            elif cmd == TRIM and seq in seqs:
                for c in seqs[seq]:
                    c.trim(c.offset - T)  # (T: the tokens it keeps)
            while len(seqs) > MAX_SEQS:
                seqs.popitem(last=False)
            try:
                outbox.put(out, nxt)
                if cmd in (STOP, FAULT):
                    outbox.flush()
            except PeerLostError:
                return 1  # the downstream rank is gone: rank 0 learns it from its own neighbour
            if cmd in (STOP, FAULT):
                return 0 if cmd == STOP else 1
    finally:
        outbox.close()


def _tell_downstream(outbox: Outbox, nxt: int, lost: int) -> None:
    try:
        outbox.put([np.asarray([FAULT, 0, 0, 0, 0, lost], dtype=np.int32)], nxt)
        outbox.flush()
    except PeerLostError:
        pass
    time.sleep(0.5)  # let the message leave before this process ends
