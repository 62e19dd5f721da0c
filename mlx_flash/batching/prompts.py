"""Prompts of several sequences: checked and encoded together, then prefilled together, and the stats
of a run of them. The throughput mode prefills its blocks here; the service and the pipeline ask for
the same when several calls' prompts arrive at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError, ContextLengthError
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
            raise ContextLengthError(f"prompt {k} has {len(ids)} tokens; the model's context is {limit}")
        out.append((ids, min(n, limit - len(ids))))
    return out


def prefill_together(
    engine, seqs: list[Sequence], order: Order, opts: SamplingOptions, eos, attend: Callable[[list], list] | None = None
) -> None:
    """Every sequence's prompt in chunks of config.prefill_chunk tokens (the chunks a single run uses),
    each round of chunks through one schedule in `order`; the first token of each is sampled.
    attend(caches): the caches a chunk attends through (the throughput mode's sparse attention), else
    the sequence's own."""
    chunk = engine.config.prefill_chunk
    while True:
        todo = [s for s in seqs if s.prefilled < len(s.ids)]
        if not todo:
            return
        batches = [
            MicroBatch(
                engine.ops.tokens(s.ids[s.prefilled : s.prefilled + chunk]), attend(s.caches) if attend else s.caches
            )
            for s in todo
        ]
        for s, logits in zip(todo, run_block(engine, batches, order)):
            s.prefilled = min(len(s.ids), s.prefilled + chunk)
            if s.prefilled == len(s.ids):
                s.take(logits[0, -1], opts, eos)
