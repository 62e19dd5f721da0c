"""Continuous batching across ranks: the server's calls, each in its own conversation (whose KV every
rank holds), decoded together. The same protocol as the one-process RunningBatch
(service/running_batch.CallBatch), so the server's engine loop drives either.

A call joins when `start` prefills its new tokens (the conversation's caches trimmed to what the
prompt starts with, on every rank) and samples its first token. Every `step` then sends the joined
calls round the ranks as one micro-batch per rank (a BatchKV of their caches on every rank), all in
flight at once, so that while rank 1 runs one group's layers rank 0 runs the next group's, and
samples each row's next token. A call leaves when it finishes or is cancelled; its conversation
then holds the prompt and the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


from ..generation import GenerationStep, TokenStats
from ..batching.sequence import SamplingOptions, Sequence
from ..service.reports import CallReport
from ..service.running_batch import CallBatch
from ..service.sequences import Conversation


@dataclass(eq=False)  # identity: a call is a key of the engine loop's table
class PipelineCall:
    conv: Conversation
    ids: list
    history: list | None
    report: CallReport  # prompt and cached tokens, for the usage the loop reports
    seq: Sequence
    opts: SamplingOptions
    error: Exception | None = None  # (the RunningBatch protocol's; a conversation's KV never runs out mid-call)

    def step_of(self, token: int, wall_s: float) -> GenerationStep:
        return GenerationStep(
            self.seq.delta(self.opts),
            token,
            TokenStats(wall_ms=wall_s * 1e3, compute_ms=wall_s * 1e3),
            self.seq.finish_reason,
        )


class PipelineRunningBatch(CallBatch):
    """A CallBatch over PipelineConversations."""

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
    ) -> tuple[PipelineCall, GenerationStep | None]:
        """Prefill a call's new tokens and sample its first token: (the call, its first step; None
        when no token fits). A call that is already done is finished here; others join the batch."""
        svc, engine = self.svc, self.svc.engine
        conv, ids, history, keep = svc.prepare(ctx_id, prompt, owner, whole, max_tokens)
        opts = SamplingOptions.of(temperature, top_p, top_k, seed, stop)
        seq = Sequence.start(0, ids, min(max_tokens, svc.max_tokens - len(ids)), conv.caches, engine.tokenizer, opts)
        call = PipelineCall(
            conv, ids, history, CallReport(context=conv.id, prompt_tokens=len(ids), cached_tokens=keep), seq, opts
        )
        conv.busy = True
        if seq.max_tokens <= 0:
            self._close(call, failed=False)
            return call, None
        try:
            t0 = time.perf_counter()
            engine.ffn.reset()
            token = seq.take(engine.prefill(ids[keep:], conv.caches), opts, set(engine.tokenizer.eos_token_ids))
        except BaseException:
            self._close(call, failed=True)
            raise
        step = call.step_of(token, time.perf_counter() - t0)
        if seq.done:
            self._close(call, failed=False)
        else:
            self.calls.append(call)
        return call, step

    def step(self) -> list[tuple[PipelineCall, GenerationStep]]:
        """One decode step of every joined call, in one micro-batch per rank (fewer with fewer calls),
        all in flight at once: (call, its step) each. Finished calls are closed and leave."""
        engine = self.svc.engine
        p, ops = engine.runner, engine.ops
        m = min(len(self.calls), p.t.size)
        self.svc.most_together = max(self.svc.most_together, len(self.calls))
        groups = [self.calls[i::m] for i in range(m)]
        eos = set(engine.tokenizer.eos_token_ids)
        out = []
        t0 = time.perf_counter()
        with ops.inference():
            for g in groups:
                p.submit(ops.tokens([[c.seq.tokens[-1]] for c in g]), [c.conv.caches for c in g])
            for g in groups:
                logits = ops.to_numpy(p.collect())
                wall = time.perf_counter() - t0
                for b, c in enumerate(g):
                    out.append((c, c.step_of(c.seq.take(logits[b, -1], c.opts, eos), wall)))
        for c, _ in out:
            if c.seq.done:
                self.finish(c)
        return out

    def _close(self, call: PipelineCall, failed: bool) -> None:
        """The conversation gains the prompt and what was sampled (a cancelled call keeps what it
        got); after a failure nothing of its caches is trusted: the next call prefills it again."""
        conv = call.conv
        conv.busy, conv.reserved = False, 0
        if failed:
            conv.held = []
        else:
            self.svc.settle(conv, call.ids, list(call.seq.tokens), call.history, call.seq.text)
