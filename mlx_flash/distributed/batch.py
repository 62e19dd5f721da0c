"""The throughput mode across ranks (FlexGen §4.4): many sequences flow through the pipeline in
micro-batches, so that every rank computes while the others do: while rank 1 runs micro-batch k's
layers, rank 0 runs its own layers for k + 1, and samples k's next tokens when its hidden state
comes back.

How many micro-batches are in flight is the stage policy's choice (distributed/stage_policy.py),
from every rank's measured stage: one per rank when the ranks compute, fewer and larger when
reading their streamed layers (once per micro-batch) bounds them. Prompts are prefilled in GROUP
messages, several sequences' chunks packed up to the engine's prefill_chunk tokens, in as many
messages as the policy's prefill choice; every rank runs a group layer by layer, so a streamed layer
is read once for the group, and each sequence computes (and its KV holds) what a single run does. The live
sequences then decode in the policy's groups of rows (batching/batch_cache.BatchKV on every rank: each
row keeps its own caches and position). A sequence that finishes is freed on every rank. Each rank's
KV for its layers must fit what its memory plan set aside: the batch's tokens are checked against
the smallest plan before anything runs.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass

from ..batching.progress_bar import chain_done, progress_bar, say, tick
from ..batching.prompts import BatchStats, encode_all
from ..batching.sequence import SamplingOptions, Sequence
from ..errors import ConfigError, MemoryBudgetError
from ..offload.engine_room import check_whole_layers
from .stage_policy import choose, choose_prefill, micro_batches_text


@dataclass
class PipelineBatchRun(BatchStats):
    ranks: int = 0
    micro_batches: int = 0
    predicted_decode_tokens_per_s: float | None = None  # the stage policy's, when it chose
    prefill_messages: int = 0
    prefill_budget: int = 0  # tokens per prefill message, at most

    def line(self) -> str:
        decode = self.generated_tokens - self.sequences  # the first token of each comes from its prefill
        rate = decode / self.decode_s if self.decode_s and decode > 0 else 0.0
        predicted = (
            f"predicted {self.predicted_decode_tokens_per_s:.1f}, "
            if self.predicted_decode_tokens_per_s is not None
            else ""
        )
        return (
            f"pipeline batch: {self.ranks} ranks, {micro_batches_text(self.micro_batches)} in flight: "
            f"{self.generated_tokens} tokens for {self.sequences} sequences in {self.seconds:.1f} s "
            f"({self.tokens_per_s:.1f} tok/s); prompts in {self.prefill_messages} messages of at most "
            f"{self.prefill_budget} tokens ({self.prefill_s:.1f} s); decode {predicted}measured {rate:.1f} tok/s"
        )


def check_kv_room(pipeline, work: list[tuple[list[int], int]]) -> None:
    """Refuse a batch whose KV some rank's memory plan does not hold (in tokens of every layer it runs)."""
    need = sum(len(ids) + n for ids, n in work)
    if pipeline.kv_tokens is None:
        return
    least = min(pipeline.kv_tokens)
    if need > least:
        rank = pipeline.kv_tokens.index(least)
        raise MemoryBudgetError(
            f"the batch needs KV for {need} tokens (prompts and token budgets together); rank "
            f"{rank}'s memory plan holds {least}: run fewer prompts at once, fewer --max-tokens, "
            "or give the ranks more memory"
        )


def decode_groups(pipeline, live: int, micro_batches: int = 0, report=None) -> int:
    """How many micro-batches the live sequences decode in: `micro_batches` when given, else the
    stage policy's choice from every rank's measured stage (stage_policy.choose; its line goes to
    `report`), else one per rank."""
    if not live:
        return 0
    if micro_batches:
        return min(live, micro_batches)
    if pipeline.stage_speeds is None:
        return min(live, pipeline.t.size)
    c = choose(pipeline.stage_speeds, live, pipeline.hop_s)
    if report:
        report(c)
    return c.micro_batches


def prefill_budget(pipeline, work: list[tuple[list[int], int]], chunk: int) -> int:
    """Tokens per prefill message: at most the engine's prefill chunk (what every rank's plan holds
    a pass of), the prompts' tokens split over as many messages as the stage policy's prefill
    choice (few when the ranks' reads bound them: each message reads every streamed layer; more
    when their compute does, to shorten the pipeline's ramp)."""
    total = sum(len(ids) for ids, _ in work)
    if pipeline.stage_speeds is None:
        m = pipeline.t.size
    else:
        m = choose_prefill(pipeline.stage_speeds, total, pipeline.hop_s)
    return max(1, min(chunk, -(-total // m)))


def run_pipelined(
    engine,
    pipeline,
    prompts,
    max_tokens,
    opts: SamplingOptions,
    policy,
    progress: bool,
    on_done=None,
    micro_batches: int = 0,
) -> tuple[list[Sequence], PipelineBatchRun]:
    """The throughput mode across the ranks (rank 0's Pipeline.run_batch): every prompt's Sequence in
    prompt order and the run's stats, with a progress bar when asked."""
    if policy is not None:
        raise ConfigError(
            "a policy places weights and KV in one process; across ranks the micro-batches "
            "flow through the pipeline instead: leave the policy out"
        )
    check_whole_layers(engine)
    work = encode_all(engine, prompts, max_tokens)
    bar = progress_bar(len(work), progress)
    t0 = time.perf_counter()
    try:
        seqs, run = pipelined_batch(
            engine,
            pipeline,
            work,
            opts,
            micro_batches,
            on_done=chain_done(on_done, bar),
            on_token=(lambda n: tick(bar, n, t0)) if bar else None,
            on_policy=(lambda c: say(bar, c.line())) if progress else None,
        )
    finally:
        if bar:
            bar.close()
    if progress:
        print(run.line(), file=sys.stderr)
    return seqs, run


def pipelined_batch(
    engine,
    p,
    work: list[tuple[list[int], int]],
    opts: SamplingOptions,
    micro_batches: int = 0,
    on_done=None,
    on_token=None,
    on_policy=None,
) -> tuple[list[Sequence], PipelineBatchRun]:
    """Every prompt's Sequence (work: encode_all's (ids, token budget) per prompt), in prompt order,
    and the run's stats, through pipeline `p`. micro_batches: decode groups in flight (0: the stage
    policy's choice, made once the prompts are prefilled; on_policy(choice) is told it)."""
    check_kv_room(p, work)
    if micro_batches < 0:
        raise ConfigError(f"micro_batches must be >= 0 (got {micro_batches})")
    run = PipelineBatchRun(sequences=len(work), prompt_tokens=sum(len(ids) for ids, _ in work), ranks=p.t.size)

    def chosen(c):
        run.predicted_decode_tokens_per_s = c.tokens_per_s
        if on_policy:
            on_policy(c)

    eos = set(engine.tokenizer.eos_token_ids)
    seqs = [
        Sequence.start(k, ids, n, engine.new_caches(len(ids) + n), engine.tokenizer, opts)  # KV sized to it
        for k, (ids, n) in enumerate(work)
    ]

    def finish(g):
        for s in [s for s in g if s.done]:
            g.remove(s)
            engine.release(s.caches)
            s.caches = None
            if on_done:
                on_done(s)

    def decode(groups):
        """Every group steps until its rows are done, all groups in flight (one message each)."""
        waiting = deque()
        for g in groups:
            p.submit(engine.ops.tokens([[s.tokens[-1]] for s in g]), [s.caches for s in g])
            waiting.append(g)
        while waiting:
            g = waiting.popleft()
            logits = engine.ops.to_numpy(p.collect())
            for b, s in enumerate(g):
                s.take(logits[b, -1], opts, eos)
            if on_token:
                on_token(len(g))
            finish(g)
            if g:
                p.submit(engine.ops.tokens([[s.tokens[-1]] for s in g]), [s.caches for s in g])
                waiting.append(g)

    def prefill(budget: int):
        """Every prompt, its chunks packed into messages of at most `budget` tokens (a sequence's
        chunks in order, one message of it in flight at a time), a message per rank in flight."""
        pending, inflight = deque(seqs), deque()
        while pending or inflight:
            while pending and len(inflight) < p.t.size:
                group, sizes, room = [], [], budget
                while pending and room > 0:
                    s = pending.popleft()
                    n = min(len(s.ids) - s.prefilled, room)
                    group.append(s)
                    sizes.append(n)
                    room -= n
                p.submit_group(
                    [s.ids[s.prefilled : s.prefilled + n] for s, n in zip(group, sizes)], [s.caches for s in group]
                )
                run.prefill_messages += 1
                inflight.append((group, sizes))
            group, sizes = inflight.popleft()
            logits = engine.ops.to_numpy(p.collect())
            made = 0
            for b, (s, n) in enumerate(zip(group, sizes)):
                s.prefilled += n
                if s.prefilled < len(s.ids):
                    pending.append(s)
                else:
                    s.take(logits[b, -1], opts, eos)
                    made += 1
            finish([s for s in group if s.prefilled == len(s.ids)])
            if on_token and made:
                on_token(made)

    with engine.ops.inference():
        t0 = time.perf_counter()
        run.prefill_budget = prefill_budget(p, work, engine.config.prefill_chunk)
        prefill(run.prefill_budget)
        run.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        live = [s for s in seqs if not s.done]
        m = decode_groups(p, len(live), micro_batches, chosen)
        run.micro_batches, run.policy = m, {"pipeline_ranks": p.t.size, "micro_batches": m}
        decode([live[i::m] for i in range(m)])
        p.drain()
        run.decode_s = time.perf_counter() - t0
    run.generated_tokens = sum(s.generated for s in seqs)
    return seqs, run
