"""The server's calls over conversations that each hold one sequence's caches (service/sequences.py),
as the one-process RunningBatch's protocol (running_batch.CallBatch) has them, so the server's engine
loop drives either; and that loop's choice of a conversation for a request.

A call joins when `start` prefills its new tokens (the conversation's caches trimmed to what the
prompt starts with) and samples its first token. Each `step` decodes one token of every joined call,
one call at a time in one process (a tiered conversation runs alone: TieredConversations holds one
at a time); a model split across ranks sends them round the ranks together instead
(distributed/running_batch.py). A call leaves when it finishes or is cancelled; its conversation then
holds the prompt and the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..batching.sequence import SamplingOptions, Sequence
from ..generation import GenerationStep, TokenStats
from .engine_loop import EngineLoop
from .reports import CallReport
from .running_batch import CallBatch
from .sequences import Conversation


@dataclass(eq=False)  # identity: a call is a key of the engine loop's table
class SequenceCall:
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


class SequenceBatch(CallBatch):
    """A CallBatch over a SequenceConversations."""

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
    ) -> tuple[SequenceCall, GenerationStep | None]:
        """Prefill a call's new tokens and sample its first token: (the call, its first step; None
        when no token fits). A call that is already done is finished here; others join the batch."""
        svc, engine = self.svc, self.svc.engine
        conv, ids, history, keep = svc.prepare(ctx_id, prompt, owner, whole, max_tokens)
        opts = SamplingOptions.of(temperature, top_p, top_k, seed, stop)
        seq = Sequence.start(0, ids, min(max_tokens, svc.max_tokens - len(ids)), conv.caches, engine.tokenizer, opts)
        call = SequenceCall(
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

    def step(self) -> list[tuple[SequenceCall, GenerationStep]]:
        """One decode step of every joined call, one after another: (call, its step) each. Finished
        calls are closed and leave."""
        engine, out = self.svc.engine, []
        eos = set(engine.tokenizer.eos_token_ids)
        for c in list(self.calls):
            t0 = time.perf_counter()
            logits = engine.forward([c.seq.tokens[-1]], c.conv.caches)
            out.append((c, c.step_of(c.seq.take(logits[-1], c.opts, eos), time.perf_counter() - t0)))
        for c, _ in out:
            if c.seq.done:
                self.finish(c)
        return out

    def _close(self, call: SequenceCall, failed: bool) -> None:
        """The conversation gains the prompt and what was sampled (a cancelled call keeps what it
        got); after a failure nothing of its caches is trusted: the next call prefills it again."""
        conv = call.conv
        conv.busy, conv.reserved = False, 0
        if failed:
            conv.held = []
        else:
            self.svc.settle(conv, call.ids, list(call.seq.tokens), call.history, call.seq.text)


class SequenceLoop(EngineLoop):
    """The server's engine loop over a SequenceConversations: a request continues the owner's idle
    conversation sharing the longest prefix with it (trimmed to it when the call starts), or starts
    one; conversations live where their caches are, with nothing to write ahead."""

    def __init__(self, conversations, max_batch: int = 1, batch: CallBatch | None = None):
        super().__init__(conversations, max_batch, batch or SequenceBatch(conversations, max_batch))

    def _context_for(self, ids: list, owner: str) -> tuple[str, str | None]:
        ctx = self.svc.match(ids, owner)
        if ctx is None:
            ctx = self.svc.new_context(owner=owner)
            return ctx, ctx
        return ctx, None

    def _swap_ahead(self) -> None:
        pass
