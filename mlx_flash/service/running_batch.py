"""Continuous batching over a Service: many calls, each in its own context, run together.

A call joins when `start` opens its context (the chunks of the longest common prefix kept, as
Service.call does). Every `step` then runs one pass of the model over two micro-batches, layer by
layer (the throughput mode's graph pieces, batching/schedule.py): the joined calls that are
decoding, one token each (`ChunkedBatchKV`: attention reads every context's chunks where they lie
in the pool, through one slot table per step), and calls still prefilling, each with its next
prompt chunk, packed into one left-padded pass of at most the engine's prefill chunk
(batching/prompts.pack_rows; shortest prompt first, each pass a call waits raising its priority).
So N clients cost one pass of the weights per step instead of N, and a long prompt goes in pieces
between the others' decode steps instead of stalling them. A call's first token is sampled when its
last chunk has run. A call leaves when it finishes, is cancelled, or its context cannot grow within
the KV budget; `finish` then writes its context back exactly as Service.call would. One thread
drives a RunningBatch (the server's engine loop), as one thread drives a Service.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


from ..generation import GenerationStep, GenerationSummary, TokenStats
from ..errors import DiskError, MemoryBudgetError
from ..batching.batch_cache import batch_caches
from ..batching.prompts import left_padded, pack_rows
from ..batching.schedule import MicroBatch, Order, run_block
from ..batching.sequence import SamplingOptions, Sequence
from .chunked_kv import chunked_batch_caches
from .context import Context
from .reports import CallReport


@dataclass(eq=False)  # identity: a call is a key of the engine loop's table
class BatchedCall:
    ctx: Context
    ids: list
    history: list | None
    report: CallReport
    caches: list
    seq: Sequence
    opts: SamplingOptions
    summary: GenerationSummary
    error: Exception | None = None  # why it left early (its context could not grow) or failed to close
    waited: int = 0  # prefill passes run without it since its last chunk (its priority for the next)

    @property
    def prefilling(self) -> bool:
        return self.seq.prefilled < len(self.ids)

    def step_of(self, token: int, stats: TokenStats) -> GenerationStep:
        self.summary.steps.append(stats)
        return GenerationStep(self.seq.delta(self.opts), token, stats, self.seq.finish_reason)


class CallBatch:
    """The protocol the server's engine loop drives (start, step, finish, close, calls, full) and its
    bookkeeping; a batch implements start, step and _close (what a call's context keeps when it leaves)."""

    def __init__(self, service, max_batch: int = 32):
        self.svc, self.max_batch = service, max_batch
        self.calls: list = []

    @property
    def full(self) -> bool:
        return len(self.calls) >= self.max_batch

    def finish(self, call, failed: bool = False) -> None:
        """The call leaves (done, cancelled or failed); its context is written back."""
        if call in self.calls:
            self.calls.remove(call)
        self._close(call, failed)

    def close(self) -> None:
        """Finish every call still running (a server shutting down)."""
        for c in list(self.calls):
            self.finish(c, failed=True)

    def _close(self, call, failed: bool) -> None:
        raise NotImplementedError


class RunningBatch(CallBatch):
    def start(
        self,
        ctx_id: str,
        prompt,
        owner: str = "",
        whole: bool = False,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop=None,
    ) -> tuple[BatchedCall, GenerationStep | None]:
        """Open a call's context and claim the chunks of its prompt and answer; the call joins the
        batch, its prompt prefilled by the next steps: (the call, None). A call with no room for a
        token is finished here; MemoryBudgetError when the KV budget cannot hold it beside the
        calls running (alone, it runs in what there is)."""
        svc, engine = self.svc, self.svc.engine
        ctx, ids, history = svc.prepare(ctx_id, prompt, owner, max_tokens, temperature, top_p, top_k, whole)
        opts = SamplingOptions.of(temperature, top_p, top_k, seed, stop)
        report = svc.new_report(ctx, ids)
        summary = GenerationSummary(prompt_tokens=len(ids))
        caches = None
        try:
            caches = svc.open_call(ctx, ids, report)
            summary.cached_tokens = report.cached_tokens
            limit = min(engine.model_context, caches[0].capacity or engine.model_context)
            seq = Sequence.start(0, ids, min(max_tokens, limit - len(ids)), caches, engine.tokenizer, opts)
            seq.prefilled = report.cached_tokens
            try:  # the chunks of its whole answer, claimed now: a call that starts beside others finishes
                ctx.table.reserve(len(ids) + seq.max_tokens)
            except MemoryBudgetError:
                if self.calls:
                    raise  # the others hold the room: the server's loop starts it when they have finished
                # alone: it runs in what there is and stops where its context can grow no further
        except BaseException:
            svc.close_call(ctx, ids, history, caches, summary, "", True, report)
            raise
        call = BatchedCall(ctx, ids, history, report, caches, seq, opts, summary)
        if seq.max_tokens <= 0:
            self._close(call, failed=False)
            return call, None
        if not self.calls:
            engine.ffn.reset()  # a sparse FFN's windows: a new sequence, alone (a batch's rows share them)
        self.calls.append(call)
        return call, None

    def step(self) -> list[tuple[BatchedCall, GenerationStep | None]]:
        """One pass: every decoding call's next token and one pass of prefill chunks (calls whose
        prompt ends in it sample their first token): (call, its step) each; a call whose context
        cannot grow gets None and its error set, and leaves. Finished calls are closed and leave."""
        engine = self.svc.engine
        out: list = []
        decoding = self._room([(c, 1) for c in self.calls if not c.prefilling], out)
        waiting = [c for c in self.calls if c.prefilling]
        chunk = engine.config.prefill_chunk
        left = [min(len(c.ids) - c.seq.prefilled, chunk) for c in waiting]  # each one's next chunk
        # shortest prompt first (the least time to first token on average), each pass a call waited
        # counting as a chunk of priority, so a long prompt is not passed over for ever
        remaining = [len(c.ids) - c.seq.prefilled for c in waiting]
        order = sorted(range(len(waiting)), key=lambda k: remaining[k] - waiting[k].waited * chunk)
        first = pack_rows(order, left, chunk)[0] if waiting else []
        chosen = {k for k, _ in first}
        for k, c in enumerate(waiting):
            c.waited = 0 if k in chosen else c.waited + 1
        prefill = self._room([(waiting[k], n) for k, n in first], out)
        batches = []
        if decoding:
            tokens = engine.ops.tokens([[c.seq.tokens[-1]] for c, _ in decoding])
            batches.append(MicroBatch(tokens, chunked_batch_caches([c.caches for c, _ in decoding])))
        if prefill:
            chunks = [c.ids[c.seq.prefilled : c.seq.prefilled + n] for c, n in prefill]
            caches = batch_caches([c.caches for c, _ in prefill], [n for _, n in prefill])
            batches.append(MicroBatch(engine.ops.tokens(left_padded(chunks)), caches))
        if batches:
            t0 = time.perf_counter()
            results = run_block(engine, batches, Order.ZIGZAG)
            wall = time.perf_counter() - t0
            eos = set(engine.tokenizer.eos_token_ids)
            for rows, logits in zip([r for r in (decoding, prefill) if r], results):
                for b, (c, n) in enumerate(rows):
                    if c.prefilling:
                        c.seq.prefilled += n
                        c.summary.prefill_s += wall  # (its share of passes shared with others' decode)
                        if c.prefilling:
                            continue
                        stats = TokenStats(wall_ms=c.summary.prefill_s * 1e3, compute_ms=c.summary.prefill_s * 1e3)
                    else:
                        c.summary.decode_s += wall
                        stats = TokenStats(wall_ms=wall * 1e3, compute_ms=wall * 1e3)
                    token = c.seq.take(logits[b, -1], c.opts, eos)
                    out.append((c, c.step_of(token, stats)))
        for c, _ in out:
            if c.seq.done or c.error is not None:
                try:
                    self.finish(c, failed=c.error is not None)
                except DiskError as e:  # its record could not be written: this call's error, not the others'
                    c.error = c.error or e
        return out

    @staticmethod
    def _room(rows: list[tuple[BatchedCall, int]], out: list) -> list[tuple[BatchedCall, int]]:
        """The rows whose contexts have chunks for their next n tokens (claimed now, before the pass
        writes them); a row without gets its error set and (call, None) in out."""
        ready = []
        for c, n in rows:
            try:
                start = c.caches[0].offset  # (what every layer has written: a claim may compress it)
                c.ctx.table.write_ready(start, start + n)
                ready.append((c, n))
            except MemoryBudgetError as e:
                c.error = e
                out.append((c, None))
        return ready

    def _close(self, call: BatchedCall, failed: bool) -> None:
        s = call.summary
        s.tokens = list(call.seq.tokens)
        s.generated_tokens = call.seq.generated
        self.svc.close_call(call.ctx, call.ids, call.history, call.caches, s, call.seq.text, failed, call.report)
