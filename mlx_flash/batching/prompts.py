"""Prompts of several sequences: checked and encoded together, then prefilled together, and the stats
of a run of them. The throughput mode prefills its blocks here; the service and the pipeline ask for
the same when several calls' prompts arrive at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError, ContextLengthError
from .batch_cache import batch_caches
from .schedule import MicroBatch, Order, run_block
from .sequence import SamplingOptions, Sequence


@dataclass
class BatchStats:
    sequences: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    bytes_read: int = 0
    blocks: int = 0
    policy: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the whole run (prefill included), FlexGen's measure."""
        return self.generated_tokens / self.seconds if self.seconds else 0.0


def encode_all(engine, prompts, max_tokens) -> list[tuple[list[int], int]]:
    """(prompt ids, token budget) of each prompt; one line naming the prompt that cannot run."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ConfigError("prompts must be a list of strings or of message lists")
    if not prompts:
        raise ConfigError("the prompt list is empty")
    budgets = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    if len(budgets) != len(prompts):
        raise ConfigError(f"{len(budgets)} max_tokens for {len(prompts)} prompts")
    limit = engine.context_limit
    out = []
    for k, (p, n) in enumerate(zip(prompts, budgets)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"prompt {k}: max_tokens must be an integer >= 1 (got {n!r})")
        try:
            ids = engine.encode_prompt(p)
        except ConfigError as e:
            raise ConfigError(f"prompt {k}: {e}") from None
        if not ids:
            raise ConfigError(f"prompt {k} encodes to zero tokens")
        if len(ids) >= limit:
            raise ContextLengthError(f"prompt {k} has {len(ids)} tokens; {engine.context_words(limit)}")
        out.append((ids, min(n, limit - len(ids))))
    return out


def prefill_together(
    engine,
    seqs: list[Sequence],
    order: Order,
    opts: SamplingOptions,
    eos,
    attend: Callable[[list], list] | None = None,
    pass_tokens: int | None = None,
) -> None:
    """Every sequence's prompt in chunks of at most config.prefill_chunk tokens (the chunks a single
    run uses), several sequences' chunks packed into one batched pass (pack_rows) of at most
    `pass_tokens` tokens (default the prefill chunk: what the memory plan holds a pass of; a caller
    that planned memory for larger passes may give more, the throughput mode's policy), each
    round's passes through one schedule in `order`; the first token of each sequence is sampled.
    attend(caches): the caches a pass attends through (the throughput mode's sparse attention), else
    the batch of the sequences' own."""
    chunk = engine.config.prefill_chunk
    budget = chunk if pass_tokens is None else max(1, pass_tokens)
    while True:
        todo = [s for s in seqs if s.prefilled < len(s.ids)]
        if not todo:
            return
        widths = [min(len(s.ids) - s.prefilled, chunk) for s in todo]  # the chunks a single run makes
        groups = pack_rows(sorted(range(len(todo)), key=lambda k: -widths[k]), widths, budget)
        passes = [[(todo[k], n) for k, n in g] for g in groups]
        batches = []
        for rows in passes:
            caches = batch_caches([s.caches for s, _ in rows], [n for _, n in rows])
            chunks = [s.ids[s.prefilled : s.prefilled + n] for s, n in rows]
            batches.append(MicroBatch(engine.ops.tokens(left_padded(chunks)), attend(caches) if attend else caches))
        for rows, logits in zip(passes, run_block(engine, batches, order)):
            for b, (s, n) in enumerate(rows):
                s.prefilled += n
                if s.prefilled == len(s.ids):
                    s.take(logits[b, -1], opts, eos)


def ragged_rows(remaining: list[int], budget: int) -> list[list[tuple[int, int]]]:
    """Passes of one prefill round: each sequence's next chunk (min(its remaining tokens, budget)),
    longest first (so a pass's shorter rows need little left padding), packed by pack_rows."""
    widths = [min(r, budget) for r in remaining]
    return pack_rows(sorted(range(len(widths)), key=lambda k: -widths[k]), widths, budget)


def pack_rows(order: list[int], widths: list[int], budget: int) -> list[list[tuple[int, int]]]:
    """Sequences `order` (indices into widths: each one's next chunk) in that order, packed into
    passes whose rows x widest chunk <= budget (the tokens the memory plan holds a pass of; a chunk
    wider than that runs alone); returns [(sequence index, tokens)] per pass."""
    if budget < 1:
        raise ValueError(f"a prefill pass needs room for at least one token (got {budget})")
    passes: list[list[tuple[int, int]]] = []
    for k in order:
        n = widths[k]
        if passes and (len(passes[-1]) + 1) * max(n, max(w for _, w in passes[-1])) <= budget:
            passes[-1].append((k, n))
        else:
            passes.append([(k, n)])
    return passes


def left_padded(chunks: list[list[int]]) -> list[list[int]]:
    """Token rows of a ragged pass, each padded on the left to the longest with its own first token
    (any id would do: the padding's keys are never stored and its outputs are dropped)."""
    width = max(len(c) for c in chunks)
    return [[c[0]] * (width - len(c)) + list(c) for c in chunks]
