"""Continuous batching over a Service: many calls, each in its own context, decoded together.

A call joins when `start` prefills its new tokens alone (its context's chunks, as Service.call
does) and samples its first token; from then on every `step` runs one batched decode pass over all
joined calls (the throughput mode's graph pieces, batching/schedule.py, with `ChunkedBatchKV`: every
context's chunks read with one gather of the pool per layer), so N clients cost one pass of the
weights per token instead of N. A call leaves when it finishes, is cancelled, or its context cannot
grow within the KV budget; `finish` then writes its context back exactly as Service.call would. One
thread drives a RunningBatch (the server's engine loop), as one thread drives a Service.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


from ..generation import GenerationStep, GenerationSummary, TokenStats
from ..errors import MemoryBudgetError
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
    error: Exception | None = None  # why it left early (its context could not grow)

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
        """Prefill a call's new tokens and sample its first token: (the call, its first step; None
        when max_tokens is 0). A call that is already done is finished here; others join the batch."""
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
            call = BatchedCall(ctx, ids, history, report, caches, seq, opts, summary)
            if seq.max_tokens <= 0:
                self._close(call, failed=False)
                return call, None
            t0 = time.perf_counter()
            engine.ffn.reset()
            logits = engine.prefill(ids[report.cached_tokens :], caches)
            summary.prefill_s = time.perf_counter() - t0
            token = seq.take(logits, opts, set(engine.tokenizer.eos_token_ids))
        except BaseException:
            svc.close_call(ctx, ids, history, caches, summary, "", True, report)
            raise
        step = call.step_of(token, TokenStats(wall_ms=summary.prefill_s * 1e3, compute_ms=summary.prefill_s * 1e3))
        if seq.done:
            self._close(call, failed=False)
        else:
            self.calls.append(call)
        return call, step

    def step(self) -> list[tuple[BatchedCall, GenerationStep | None]]:
        """One decode pass over every joined call: (call, its step) each; a call whose context cannot
        grow gets None and its error set, and leaves. Finished calls are closed and leave."""
        engine = self.svc.engine
        ready, out = [], []
        for c in self.calls:
            try:
                c.ctx.table.reserve(c.caches[0].offset + 1)  # its next token's chunk, before the pass writes it
                ready.append(c)
            except MemoryBudgetError as e:
                c.error = e
                out.append((c, None))
        if ready:
            t0 = time.perf_counter()
            batch = MicroBatch(
                engine.ops.tokens([[c.seq.tokens[-1]] for c in ready]), chunked_batch_caches([c.caches for c in ready])
            )
            logits = run_block(engine, [batch], Order.ZIGZAG)[0]
            wall = (time.perf_counter() - t0) * 1e3
            eos = set(engine.tokenizer.eos_token_ids)
            for b, c in enumerate(ready):
                token = c.seq.take(logits[b, -1], c.opts, eos)
                c.summary.decode_s += wall / 1e3
                out.append((c, c.step_of(token, TokenStats(wall_ms=wall, compute_ms=wall))))
        for c, _ in out:
            if c.seq.done or c.error is not None:
                self.finish(c, failed=c.error is not None)
        return out

    def _close(self, call: BatchedCall, failed: bool) -> None:
        s = call.summary
        s.tokens = list(call.seq.tokens)
        s.generated_tokens = call.seq.generated
        self.svc.close_call(call.ctx, call.ids, call.history, call.caches, s, call.seq.text, failed, call.report)
