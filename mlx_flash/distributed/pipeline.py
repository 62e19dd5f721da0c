"""Pipeline-parallel inference: rank r runs a contiguous range of layers (stages.plan_stages); hidden
states pass between ranks over a Transport; rank 0 owns the tokenizer, embeddings, head and sampling
and is an ordinary Engine to every caller (chat, server, API) whose model call goes round the ring.

Every message is a header (int32 [HEADER]: command, sequence, batch, tokens, all-logits, faulty
rank) and, for a forward step, the hidden state [B, T, D] float32 (exact: the backends compute in
float32, or in a type float32 holds exactly). Rank 0 sends to rank 1; each rank runs its layers and
sends on; the last rank sends back to rank 0, so every command is acknowledged by the message that
comes round, which is also how rank 0 learns that every rank is alive:

  NEW_SEQ  a new sequence: every rank makes KV caches for its layers under this sequence number
  FORWARD  run your layers on the hidden state of these tokens with that sequence's caches
  STOP     leave the serving loop
  FAULT    a rank lost its upstream neighbour (header[5] names it): passed on to rank 0, which reports it

A rank that dies is named by the rank that loses its connection to it; a stage that stalls makes
rank 0 give up after `timeout` seconds, naming the ranks it waited on.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import OrderedDict

import numpy as np

from ..errors import FlashError
from .transport import PeerLostError, Transport

HEADER = 6
FORWARD, NEW_SEQ, STOP, FAULT = 1, 2, 3, 4
MAX_SEQS = 16  # sequences whose caches every rank keeps (least recently used dropped first)


class PipelineFault(FlashError):
    """A rank died or stalled: the pipeline cannot go on."""


def run_layers(engine, layers: range, h: np.ndarray, caches) -> np.ndarray:
    """This rank's layers on hidden state h [B, T, D] (numpy float32) with the engine's graph."""
    ops, mod = engine.ops, engine.module
    with ops.inference():
        x = ops.array(h)
        for i in layers:
            x = mod.block(ops, engine.args, engine.weights["layers"][i], i, x, caches[i], engine.ffn)
        return np.asarray(ops.to_numpy(x), dtype=np.float32)


class Pipeline:
    """Rank 0's side: the model call of its Engine (Engine.forward calls `forward`)."""

    def __init__(self, engine, transport: Transport, stages: list[range], timeout: float = 30.0):
        if transport.rank != 0:
            raise ValueError("the Pipeline object is rank 0's; other ranks run serve()")
        self.engine, self.t, self.stages, self.timeout = engine, transport, stages, timeout
        self.seqs: OrderedDict[int, object] = OrderedDict()  # sequence number -> rank 0's caches (kept alive)
        self.next_seq = 0
        self.broken: str | None = None
        self.round_trips = 0
        # one watchdog for the pipeline's life: armed with a deadline for each round, not a thread each
        self._deadline: float | None = None
        self._cv = threading.Condition()
        threading.Thread(target=self._watch, daemon=True).start()

    # ---- the model call ---------------------------------------------------------------------------
    def forward(self, tokens, caches, all_logits: bool):
        e, ops = self.engine, self.engine.ops
        mod = e.module
        seq = self._seq_of(caches)
        h = mod.embed(ops, e.args, e.weights, tokens, caches)
        for i in self.stages[0]:
            h = mod.block(ops, e.args, e.weights["layers"][i], i, h, caches[i], e.ffn)
        if self.t.size > 1:
            x = np.asarray(ops.to_numpy(h), dtype=np.float32)
            B, T, D = x.shape
            # (rank 0's caches of the other ranks' layers stay empty: those ranks hold them)
            h = ops.array(self._round([FORWARD, seq, B, T, int(all_logits), -1], x))
        return mod.head(ops, e.args, e.weights, h, all_logits)

    def new_sequence(self, caches) -> None:
        """Caches for a new sequence: every rank makes its own under a new number."""
        seq = self.next_seq
        self.next_seq += 1
        self.seqs[seq] = caches
        while len(self.seqs) > MAX_SEQS:
            self.seqs.popitem(last=False)
        if self.t.size > 1:
            self._round([NEW_SEQ, seq, 0, 0, 0, -1])

    def stop(self) -> None:
        """Every other rank leaves its serving loop (best effort: a broken pipeline has nobody to tell)."""
        if self.t.size > 1 and self.broken is None:
            try:
                self._round([STOP, 0, 0, 0, 0, -1])
            except PipelineFault:
                return
        self.t.close()

    # ---- one message round the ring ----------------------------------------------------------------
    def _seq_of(self, caches) -> int:
        for seq, c in self.seqs.items():
            if c is caches:
                self.seqs.move_to_end(seq)
                return seq
        raise FlashError("these KV caches were not made by this engine's new_caches() (a pipeline keeps each "
                         "rank's caches under the sequence new_caches() started)")

    def _round(self, header: list[int], payload: np.ndarray | None = None) -> np.ndarray | None:
        if self.broken is not None:
            raise PipelineFault(self.broken)
        last = self.t.size - 1
        with self._cv:
            self._deadline = time.monotonic() + self.timeout
            self._cv.notify()
        try:
            self.t.send(np.asarray(header, dtype=np.int32), 1)
            if payload is not None:
                self.t.send(payload, 1)
            back = self.t.recv((HEADER,), np.int32, last)
            if back[0] == FAULT:
                raise PeerLostError(int(back[5]), f"lost (its downstream neighbour, rank {int(back[5]) + 1}, "
                                    "could not receive from it)")
            out = self.t.recv(payload.shape, np.float32, last) if payload is not None else None
        except PeerLostError as err:
            self.broken = f"pipeline stopped: {err}"
            raise PipelineFault(self.broken) from None
        finally:
            with self._cv:
                self._deadline = None
        self.round_trips += 1
        return out

    def _watch(self) -> None:
        """A stalled rank never answers and never drops its connection: when a round outlives its
        deadline (`timeout` seconds), rank 0 names the ranks it waited on and exits, rather than hang."""
        with self._cv:
            while self._deadline is None or time.monotonic() < self._deadline:
                self._cv.wait(None if self._deadline is None else self._deadline - time.monotonic())
        ranks = "rank 1" if self.t.size == 2 else f"ranks 1-{self.t.size - 1}"
        print(f"error: pipeline stopped: no answer from {ranks} within {self.timeout:g} s (a rank stalled or "
              "its machine stopped answering)", file=sys.stderr, flush=True)
        os._exit(3)


def serve(engine, transport: Transport, stages: list[range]) -> int:
    """A rank other than 0: run this rank's layers on every FORWARD until STOP. Returns the exit
    status (0 after STOP; 1 when the upstream neighbour was lost, after telling rank 0 which)."""
    r, size = transport.rank, transport.size
    prev, nxt = r - 1, (r + 1) % size
    mine = range(len(stages[r]))  # the engine holds this rank's stage alone, its layers numbered from 0
    seqs: OrderedDict[int, list] = OrderedDict()
    while True:
        try:
            header = transport.recv((HEADER,), np.int32, prev)
            cmd, seq, B, T = (int(v) for v in header[:4])
            payload = transport.recv((B, T, engine.args.hidden_size), np.float32, prev) if cmd == FORWARD else None
        except PeerLostError:
            _tell_downstream(transport, nxt, prev)
            return 1
        if cmd == FORWARD:
            caches = seqs.get(seq)
            if caches is None:
                caches = seqs[seq] = engine.new_caches()
            seqs.move_to_end(seq)
            payload = run_layers(engine, mine, payload, caches)
        elif cmd == NEW_SEQ:
            seqs[seq] = engine.new_caches()
            while len(seqs) > MAX_SEQS:
                seqs.popitem(last=False)
        try:
            transport.send(np.asarray(header, dtype=np.int32), nxt)
            if payload is not None:
                transport.send(payload, nxt)
        except PeerLostError:
            return 1  # the downstream rank is gone: rank 0 learns it from its own neighbour
        if cmd in (STOP, FAULT):
            return 0 if cmd == STOP else 1


def _tell_downstream(transport: Transport, nxt: int, lost: int) -> None:
    try:
        transport.send(np.asarray([FAULT, 0, 0, 0, 0, lost], dtype=np.int32), nxt)
    except PeerLostError:
        pass
    time.sleep(0.5)  # let the message leave before this process ends
