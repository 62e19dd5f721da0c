"""One sequence of a batch: its prompt, its KV caches, what it has generated and why it stopped.

Text is made by the finishing rules `Engine.stream_tokens` uses too (batching/finishing.py), so a
sequence's text in a batch is its text alone whenever its tokens are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..sampling import sample
from .finishing import TextStream


@dataclass
class SamplingOptions:
    """generate()'s sampling options, shared by every sequence of a batch (each has its own rng,
    seeded with `seed`, so a sequence samples as it would alone)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple = ()

    @classmethod
    def of(
        cls, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=None
    ) -> "SamplingOptions":
        """From generate()'s arguments: `stop` one string or several (empty ones dropped)."""
        stops = tuple(s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s)
        return cls(temperature, top_p, top_k, seed, stops)


@dataclass
class Sequence:
    index: int  # its place in the caller's prompt list
    ids: list  # prompt token ids
    max_tokens: int
    caches: list  # one LayerKV per layer
    stream: TextStream  # its text and finish (batching/finishing.py)
    rng: np.random.Generator
    prefilled: int = 0  # prompt tokens already in the caches
    tokens: list = field(default_factory=list)  # sampled, the final EOS included
    reported: bool = False  # handed to the caller's on_done

    @classmethod
    def start(cls, index: int, ids: list, max_tokens: int, caches: list, tokenizer, opts: SamplingOptions) -> Sequence:
        """A sequence about to run: its text starts after the prompt, its rng from opts.seed (so it
        samples as it would alone)."""
        return cls(
            index, ids, max_tokens, caches, TextStream(tokenizer.detokenizer(ids)), np.random.default_rng(opts.seed)
        )

    @property
    def done(self) -> bool:
        return self.stream.done

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def finish_reason(self) -> str | None:
        return self.stream.finish_reason

    @property
    def generated(self) -> int:
        """Tokens generated, an ending EOS not counted (as GenerationSummary.generated_tokens)."""
        return len(self.tokens) - self.stream.ended_on_eos

    def take(self, logits: np.ndarray, opts: SamplingOptions, eos_ids) -> int:
        """Sample the next token from this sequence's logits [vocab] and account for it; returns it."""
        token = sample(logits, opts.temperature, opts.top_p, opts.top_k, self.rng)
        self.tokens.append(token)
        self.stream.add(token, eos_ids, opts.stop, last=len(self.tokens) == self.max_tokens)
        return token

    def delta(self, opts: SamplingOptions) -> str:
        """The text made since the last delta that a stream may show (TextStream.delta)."""
        return self.stream.delta(opts.stop)
