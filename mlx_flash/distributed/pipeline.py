"""Pipeline-parallel inference: rank r runs a contiguous range of layers (stages.plan_stages); hidden
states pass between ranks over a Transport; rank 0 owns the tokenizer, embeddings, head and sampling
and is an ordinary Engine to every caller (chat, server, API) whose model call goes round the ring.

Every message is a header (int32 [HEADER]: command, sequence, rows, tokens, all-logits, faulty
rank), and for a forward step the rows' sequence numbers (int32 [rows]) and their hidden state
[rows, T, D] float32 (exact: the backends compute in float32, or in a type float32 holds exactly).
Rank 0 sends to rank 1; each rank runs its layers and sends on; the last rank sends back to rank 0,
so every command is acknowledged by the message that comes round, which is also how rank 0 learns
that every rank is alive:

  NEW_SEQ  a new sequence of at most `tokens` tokens: every rank makes KV caches for its layers under
           this sequence number
  FORWARD  run your layers on these rows' hidden states, each row with its sequence's caches (one
           row: that sequence's caches; several: a batch over them, batching/batch_cache.BatchKV)
  GROUP    several sequences' prompt chunks of different lengths (int32 [rows] sequence numbers, int32
           [rows] lengths, then [sum of lengths, D] float32): run your layers layer by layer over
           all of them, so a layer read from flash is read once for the whole group (FlexGen's
           zig-zag order over the group; each sequence computes as it would alone)
  FREE     that sequence is done: drop its caches
  TRIM     that sequence keeps its first `tokens` tokens (a conversation whose next prompt differs
           from what its caches hold past there)
  STOP     leave the serving loop
  FAULT    a rank lost its upstream neighbour (header[5] names it): passed on to rank 0, which reports it

Several messages may be in flight at once (`submit` / `collect`): while rank 1 runs micro-batch k,
rank 0 runs its layers for micro-batch k + 1 (FlexGen §4.4; distributed/batch.py). Every rank sends
through an Outbox thread, so that it goes on receiving while a send waits. Messages come back in the
order they were sent.

The other ranks' side is rank_serve.py. A rank that dies is named by the rank that loses its
connection to it; a stage that stalls makes rank 0 give up after `timeout` seconds, naming the
ranks it waited on.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import OrderedDict, deque

import numpy as np

from ..errors import FlashError, PipelineFault
from ..batching.batch_cache import batch_caches
from ..batching.prompts import ragged_rows
from ..batching.schedule import LayerOnce
from ..runner import Runner
from .batch import run_pipelined
from .transport import Outbox, PeerLostError, Transport

HEADER = 6
FORWARD, NEW_SEQ, STOP, FAULT, FREE, TRIM, GROUP = 1, 2, 3, 4, 5, 6, 7
# Sequences whose caches every rank keeps when nobody frees them (a chat's answers): least recently
# used dropped first. The throughput mode frees each sequence as it finishes.
MAX_SEQS = 256


def run_layers(engine, layers: range, h: np.ndarray, caches) -> np.ndarray:
    """This rank's layers on hidden state h [B, T, D] (numpy float32) with the engine's graph."""
    ops, mod = engine.ops, engine.module
    with ops.inference():
        x = ops.array(h)
        for i in layers:
            x = mod.block(ops, engine.args, engine.weights["layers"][i], i, x, caches[i], engine.ffn)
        return np.asarray(ops.to_numpy(x), dtype=np.float32)


def run_group(engine, layers: range, hs: list, caches: list) -> list:
    """This rank's layers over several sequences (hs[k]: [1, T_k, D] framework arrays, caches[k] that
    sequence's caches): rows of similar length packed into left-padded passes of at most the group's
    tokens (batching/prompts.pack_rows; each row computes as it would alone), the passes layer by
    layer, so each layer's weights are fetched once for all of them (batching/schedule.LayerOnce)."""
    ops, mod, w = engine.ops, engine.module, engine.weights
    ffn = LayerOnce(engine.ffn) if engine.ffn.same_for_every_input else engine.ffn
    widths = [int(h.shape[1]) for h in hs]
    passes = ragged_rows(widths, sum(widths))
    out = list(hs)
    with ops.inference():
        xs = [_left_padded(ops, [hs[k] for k, _ in p], max(n for _, n in p)) for p in passes]
        kv = [batch_caches([caches[k] for k, _ in p], [widths[k] for k, _ in p]) for p in passes]
        for i in layers:
            lw = w["layers"][i]  # (a streamed layer is read here, once)
            for q in range(len(passes)):
                xs[q] = mod.block(ops, engine.args, lw, i, xs[q], kv[q][i], ffn)
                ops.materialize(xs[q])  # done with this layer's weights before a read may refill them
        for p, x in zip(passes, xs):
            T = int(x.shape[1])
            for b, (k, _) in enumerate(p):
                out[k] = x[b : b + 1, T - widths[k] :]
    return out


def _left_padded(ops, rows: list, T: int):
    """Rows [1, n, D] as one [rows, T, D] pass, zeros before each shorter row (a padding column's
    output is dropped); one row of T tokens as it is."""
    padded = [
        h if int(h.shape[1]) == T else ops.concatenate([ops.zeros((1, T - int(h.shape[1]), h.shape[2]), like=h), h], 1)
        for h in rows
    ]
    return padded[0] if len(padded) == 1 else ops.concatenate(padded, axis=0)


def split_rows(ops, payload: np.ndarray, lengths) -> list:
    """[sum of lengths, D] numpy -> one [1, T_k, D] framework array per sequence."""
    bounds = np.cumsum([0] + [int(n) for n in lengths])
    return [ops.array(payload[None, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def joined_rows(ops, hs: list) -> np.ndarray:
    return np.concatenate([np.asarray(ops.to_numpy(h), dtype=np.float32)[0] for h in hs])


def rows_caches(rows: list):
    """The per-layer caches a step of these sequences runs with: one sequence's own, or a batch."""
    return rows[0] if len(rows) == 1 else batch_caches(rows)


class Pipeline(Runner):
    """Rank 0's side, its engine's runner (runner.py): rank 0's layers run through `engine` (the stage it
    loaded), the others' on their ranks. Engine.with_runner(pipeline) is the engine that asks it."""

    def __init__(
        self,
        engine,
        transport: Transport,
        stages: list[range],
        timeout: float = 30.0,
        kv_tokens: list[int] | None = None,
        held_ffn_layers: list[int] | None = None,
        stage_speeds: list | None = None,
        hop_s: float = 0.0,
        store_path: str = "",
    ):
        if transport.rank != 0:
            raise ValueError("the Pipeline object is rank 0's; other ranks run rank_serve.serve()")
        self.engine, self.t, self.stages, self.timeout = engine, transport, stages, timeout
        self.store_path = store_path  # the whole model's store, which rank 0's stage store was cut from
        # tokens of KV each rank's memory plan holds (None: not exchanged): a batch must fit them all
        self.kv_tokens = kv_tokens
        self.seqs: OrderedDict[int, object] = OrderedDict()  # sequence number -> rank 0's caches (kept alive)
        self.next_seq = 0
        self.broken: str | None = None
        # FFN layers each rank holds in the throughput mode (the others stream whole)
        self.held_ffn_layers = held_ffn_layers or [0] * transport.size
        # every rank's measured stage (stage_policy.StageSpeed; None: not measured) and the cost of a
        # message between ranks: the throughput mode's micro-batch count is searched from them
        self.stage_speeds, self.hop_s = stage_speeds, hop_s
        self.outbox = Outbox(transport)
        # what each message in flight brings back, oldest first: ("echo", None), ("logits", all_logits), or
        # ("ready", logits) in a pipeline of one rank
        self.inflight: deque = deque()
        # one watchdog for the pipeline's life: armed with a deadline while rank 0 waits, not a thread each
        self._deadline: float | None = None
        self._cv = threading.Condition()
        self._on_stall = None  # None: a stall ends the process (see report_stalls_to)
        threading.Thread(target=self._watch, daemon=True).start()

    def report_stalls_to(self, callback) -> None:
        """A stall marks the pipeline broken and calls callback(message) instead of ending the process
        (a server answers 503 rather than vanish; the wait that stalled stays blocked)."""
        self._on_stall = callback

    # ---- the model call ---------------------------------------------------------------------------
    def run_batch(
        self,
        engine,
        prompts,
        max_tokens,
        opts,
        policy,
        progress: bool,
        on_done=None,
        kv_bits=(0,),
        micro_batches: int = 0,
    ):
        """The throughput mode across the ranks (distributed/batch.py; kv_bits are a one-process
        policy's and are not used): micro-batches flow through them."""
        return run_pipelined(engine, self, prompts, max_tokens, opts, policy, progress, on_done, micro_batches)

    def forward(self, engine, tokens, caches, all_logits: bool):
        """One sequence's step, round the ranks and back (nothing else in flight); rank 0's layers run
        through the stage engine this pipeline was made with."""
        self.submit(tokens, [caches], all_logits)
        return self.collect()

    def submit(self, tokens, rows: list, all_logits: bool = False) -> None:
        """Start a step of `rows` (each a sequence's caches from new_caches(); tokens [rows, T]): rank
        0's layers run now, the others' as the message goes round; collect() returns its logits."""
        e, ops = self.engine, self.engine.ops
        mod = e.module
        ids = np.asarray([self._seq_of(c) for c in rows], dtype=np.int32)
        caches = rows_caches(rows)
        h = mod.embed(ops, e.args, e.weights, tokens, caches)
        for i in self.stages[0]:
            h = mod.block(ops, e.args, e.weights["layers"][i], i, h, caches[i], e.ffn)
        if self.t.size == 1:
            self.inflight.append(("ready", mod.head(ops, e.args, e.weights, h, all_logits)))
            return
        x = np.asarray(ops.to_numpy(h), dtype=np.float32)
        B, T, _ = x.shape
        # (rank 0's caches of the other ranks' layers stay empty: those ranks hold them)
        self._post([FORWARD, 0, B, T, int(all_logits), -1], ids, x)
        self.inflight.append(("logits", all_logits))

    def submit_group(self, chunks: list, rows: list) -> None:
        """Start a step of several sequences' prompt chunks (chunks[k]: token ids of sequence k, whose
        caches are rows[k]; lengths may differ) as one message: every rank runs its layers over the
        group layer by layer (run_group). collect() returns each one's last-token logits [rows, 1, vocab]."""
        e, ops = self.engine, self.engine.ops
        ids = np.asarray([self._seq_of(c) for c in rows], dtype=np.int32)
        with ops.inference():
            hs = [e.module.embed(ops, e.args, e.weights, ops.tokens([list(c)]), r) for c, r in zip(chunks, rows)]
        hs = run_group(e, self.stages[0], hs, rows)
        if self.t.size == 1:
            self.inflight.append(("ready", self._group_logits(hs)))
            return
        lengths = np.asarray([len(c) for c in chunks], dtype=np.int32)
        self._post([GROUP, 0, len(rows), int(lengths.sum()), 0, -1], ids, joined_rows(ops, hs), lengths)
        self.inflight.append(("group", None))

    def _group_logits(self, hs: list):
        """Each sequence's last-token logits, the head run on each alone (as a single run does)."""
        e, ops = self.engine, self.engine.ops
        with ops.inference():
            return ops.concatenate([e.module.head(ops, e.args, e.weights, h) for h in hs], axis=0)

    def collect(self):
        """The logits [rows, T or 1, vocab] of the oldest step submitted (framework array)."""
        self._take_echoes()
        if not self.inflight:
            raise FlashError("no step in flight to collect")
        kind, value = self.inflight.popleft()
        if kind == "ready":
            return value
        e = self.engine
        if kind == "group":
            lengths, payload = self._take()
            return self._group_logits(split_rows(e.ops, payload, lengths))
        return e.module.head(e.ops, e.args, e.weights, e.ops.array(self._take()), value)

    def new_sequence(self, caches, tokens: int) -> None:
        """Caches for a new sequence of at most `tokens` tokens: every rank makes its own under a new
        number."""
        seq = self.next_seq
        self.next_seq += 1
        self.seqs[seq] = caches
        while len(self.seqs) > MAX_SEQS:
            self.seqs.popitem(last=False)
        if self.t.size > 1:
            self._round([NEW_SEQ, seq, 0, tokens, 0, -1])

    def free(self, caches) -> None:
        """That sequence is done: every rank drops its caches (the echo is collected with the next step's);
        a broken pipeline has no rank to tell."""
        if self.broken is not None:
            return
        seq = self._seq_of(caches)
        del self.seqs[seq]
        if self.t.size > 1:
            self._post([FREE, seq, 0, 0, 0, -1])
            self.inflight.append(("echo", None))

    def trim(self, caches, keep: int) -> None:
        """That sequence's caches keep their first `keep` tokens, on every rank (nothing in flight)."""
        seq = self._seq_of(caches)
        for c in caches:
            c.trim(c.offset - keep)
        if self.t.size > 1:
            self._round([TRIM, seq, 0, keep, 0, -1])

    def drain(self) -> None:
        """Take back every message still in flight (their logits, if any, are dropped)."""
        while self.inflight:
            kind, _ = self.inflight.popleft()
            if kind != "ready":
                self._take()

    def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Every other rank leaves its serving loop (best effort: a broken pipeline has nobody to tell)."""
        if self.t.size > 1 and self.broken is None:
            try:
                self.drain()
                self._round([STOP, 0, 0, 0, 0, -1])
            except PipelineFault:
                pass
        self.outbox.close()
        if self.broken is None:  # (leaving a group whose peer stalled could wait for it)
            self.t.close()

    # ---- messages round the ring ------------------------------------------------------------------
    def _seq_of(self, caches) -> int:
        for seq, c in self.seqs.items():
            if c is caches:
                self.seqs.move_to_end(seq)
                return seq
        raise FlashError(
            "these KV caches were not made by this engine's new_caches() (a pipeline keeps each "
            "rank's caches under the sequence new_caches() started)"
        )

    def _round(self, header: list[int]) -> None:
        """A command round the ring and back, with no step in flight (freed sequences' echoes are
        taken first)."""
        self._take_echoes()
        if self.inflight:
            raise FlashError(f"{len(self.inflight)} step(s) still in flight: collect them first")
        self._post(header)
        self._take()

    def _take_echoes(self) -> None:
        while self.inflight and self.inflight[0][0] == "echo":
            self.inflight.popleft()
            self._take()

    def _post(
        self,
        header: list[int],
        ids: np.ndarray | None = None,
        payload: np.ndarray | None = None,
        lengths: np.ndarray | None = None,
    ) -> None:
        if self.broken is not None:
            raise PipelineFault(self.broken)
        arrays = [np.asarray(header, dtype=np.int32)] + ([ids] if ids is not None else [])
        arrays += ([lengths] if lengths is not None else []) + ([payload] if payload is not None else [])
        try:
            self.outbox.put(arrays, 1)
        except PeerLostError as err:
            self._break(err)

    def _take(self):
        """The next message back from the last rank: its hidden state, if it carries one (a GROUP's:
        (lengths, hidden state))."""
        if self.broken is not None:
            raise PipelineFault(self.broken)
        last = self.t.size - 1
        with self._cv:
            self._deadline = time.monotonic() + self.timeout
            self._cv.notify()
        try:
            back = self.t.recv((HEADER,), np.int32, last)
            if back[0] == FAULT:
                raise PeerLostError(
                    int(back[5]), f"lost (its downstream neighbour, rank {int(back[5]) + 1}, could not receive from it)"
                )
            out = None
            if back[0] == FORWARD:
                B, T = int(back[2]), int(back[3])
                self.t.recv((B,), np.int32, last)
                out = self.t.recv((B, T, self.engine.args.hidden_size), np.float32, last)
            elif back[0] == GROUP:
                B, total = int(back[2]), int(back[3])
                self.t.recv((B,), np.int32, last)
                lengths = self.t.recv((B,), np.int32, last)
                out = lengths, self.t.recv((total, self.engine.args.hidden_size), np.float32, last)
        except PeerLostError as err:
            self._break(err)
        finally:
            with self._cv:
                self._deadline = None
        return out

    def _break(self, err: PeerLostError):
        self.broken = f"pipeline stopped: {err}"
        self.inflight.clear()
        raise PipelineFault(self.broken) from None

    def _watch(self) -> None:
        """A stalled rank never answers and never drops its connection: when a wait outlives its
        deadline (`timeout` seconds), rank 0 names the ranks it waited on and exits, rather than hang
        (or, with report_stalls_to, marks the pipeline broken and reports it)."""
        with self._cv:
            while self._deadline is None or time.monotonic() < self._deadline:
                self._cv.wait(None if self._deadline is None else self._deadline - time.monotonic())
        ranks = "rank 1" if self.t.size == 2 else f"ranks 1-{self.t.size - 1}"
        message = (
            f"pipeline stopped: no answer from {ranks} within {self.timeout:g} s (a rank stalled or its "
            "machine stopped answering)"
        )
        if self._on_stall is not None:
            self.broken = message
            self._on_stall(message)
            return
        print(f"error: {message}", file=sys.stderr, flush=True)
        os._exit(3)
