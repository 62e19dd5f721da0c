"""The throughput mode across ranks (FlexGen §4.4): many sequences flow through the pipeline in
micro-batches, so that every rank computes while the others do. Rank 0 keeps one micro-batch in
flight per rank: while rank 1 runs micro-batch k's layers, rank 0 runs its own layers for k + 1, and
samples k's next tokens when its hidden state comes back.

Prompts are prefilled one sequence at a time (each its own message, in chunks of the engine's
prefill_chunk, so its KV is what a single run computes), several sequences in flight at once; then
the live sequences decode in `micro_batches` groups of rows (models/batch_cache.BatchKV on every
rank: each row keeps its own caches and position). A sequence that finishes is freed on every rank.
Each rank's KV for its layers must fit what its memory plan set aside: the batch's tokens are
checked against the smallest plan before anything runs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, MemoryBudgetError
from ..offload.batch_generate import BatchStats
from ..offload.sequence import SamplingOptions, Sequence


@dataclass
class PipelineBatchRun(BatchStats):
    ranks: int = 0
    micro_batches: int = 0

    def line(self) -> str:
        return (f"pipeline batch: {self.ranks} ranks, {self.micro_batches} micro-batches in flight: "
                f"{self.generated_tokens} tokens for {self.sequences} sequences in {self.seconds:.1f} s "
                f"({self.tokens_per_s:.1f} tok/s)")


def check_kv_room(pipeline, work: list[tuple[list[int], int]]) -> None:
    """Refuse a batch whose KV some rank's memory plan does not hold (in tokens of every layer it runs)."""
    need = sum(len(ids) + n for ids, n in work)
    if pipeline.kv_tokens is None:
        return
    least = min(pipeline.kv_tokens)
    if need > least:
        rank = pipeline.kv_tokens.index(least)
        raise MemoryBudgetError(f"the batch needs KV for {need} tokens (prompts and token budgets together); rank "
                                f"{rank}'s memory plan holds {least}: run fewer prompts at once, fewer --max-tokens, "
                                "or give the ranks more memory")


def pipelined_batch(engine, work: list[tuple[list[int], int]], opts: SamplingOptions, micro_batches: int = 0,
                    on_done=None, on_token=None) -> tuple[list[Sequence], PipelineBatchRun]:
    """Every prompt's Sequence (work: encode_all's (ids, token budget) per prompt), in prompt order,
    and the run's stats. micro_batches: decode groups in flight (0: one per rank)."""
    p = engine.pipeline
    check_kv_room(p, work)
    depth = p.t.size
    m = min(len(work), micro_batches or depth)
    if m < 1:
        raise ConfigError(f"micro_batches must be >= 1 (got {micro_batches})")
    run = PipelineBatchRun(sequences=len(work), prompt_tokens=sum(len(ids) for ids, _ in work), ranks=p.t.size,
                           micro_batches=m, policy={"pipeline_ranks": p.t.size, "micro_batches": m})
    eos = set(engine.tokenizer.eos_token_ids)
    seqs = [Sequence(index=k, ids=ids, max_tokens=n, caches=engine.new_caches(len(ids) + n),  # KV sized to it
                     detok=engine.tokenizer.detokenizer(ids), rng=np.random.default_rng(opts.seed))
            for k, (ids, n) in enumerate(work)]
    chunk = engine.config.prefill_chunk

    def prefill_step(g):
        s = g[0]
        return [s.ids[s.prefilled:s.prefilled + chunk]]

    def prefilled(g, logits) -> int:
        s = g[0]
        s.prefilled = min(len(s.ids), s.prefilled + chunk)
        if s.prefilled < len(s.ids):
            return 0
        s.take(logits[0, -1], opts, eos)
        return 1

    def decoded(g, logits) -> int:
        for b, s in enumerate(g):
            s.take(logits[b, -1], opts, eos)
        return len(g)

    def finish(g):
        for s in [s for s in g if s.done]:
            g.remove(s)
            engine.release(s.caches)
            s.caches = None
            if on_done:
                on_done(s)

    def flow(groups, step, advance, more):
        """Run every group while it has rows and more(group), `depth` messages in flight."""
        ready, waiting = deque(groups), deque()
        while ready or waiting:
            while ready and len(waiting) < depth:
                g = ready.popleft()
                p.submit(engine.ops.tokens(step(g)), [s.caches for s in g])
                waiting.append(g)
            g = waiting.popleft()
            made = advance(g, engine.ops.to_numpy(p.collect()))
            finish(g)
            if on_token and made:
                on_token(made)
            if g and more(g):
                ready.append(g)

    with engine.ops.inference():
        t0 = time.perf_counter()
        flow([[s] for s in seqs], prefill_step, prefilled, lambda g: g[0].prefilled < len(g[0].ids))
        run.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        live = [s for s in seqs if not s.done]
        groups = [live[i::m] for i in range(m)] if live else []
        flow([g for g in groups if g], lambda g: [[s.tokens[-1]] for s in g], decoded, lambda g: True)
        p.drain()
        run.decode_s = time.perf_counter() - t0
    run.generated_tokens = sum(s.generated for s in seqs)
    return seqs, run
