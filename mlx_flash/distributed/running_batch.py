"""Continuous batching across ranks: the server's calls, each in its own conversation (whose KV every
rank holds), decoded together; calls start and leave as service/sequence_batch.SequenceBatch's do
(their prefill and trim run on every rank through the pipeline's runner). Every `step` sends the
joined calls round the ranks as one micro-batch per rank (a BatchKV of their caches on every rank),
all in flight at once, so that while rank 1 runs one group's layers rank 0 runs the next group's,
and samples each row's next token.
"""

from __future__ import annotations

import time

from ..generation import GenerationStep
from ..service.sequence_batch import SequenceBatch, SequenceCall


class PipelineRunningBatch(SequenceBatch):
    """A SequenceBatch over PipelineConversations, its calls decoded together across the ranks."""

    def step(self) -> list[tuple[SequenceCall, GenerationStep]]:
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
