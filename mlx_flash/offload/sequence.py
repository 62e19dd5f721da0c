"""One sequence of a batch: its prompt, its KV caches, what it has generated and why it stopped.

Text is made exactly as `Engine.stream_tokens` makes it (the same incremental detokenizer, stop
strings cut where they start, EOS finishing with "stop" and the token budget with "length"), so a
sequence's text in a batch is its text alone whenever its tokens are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..sampling import partial_stop, sample


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
    def of(cls, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
           stop=None) -> "SamplingOptions":
        """From generate()'s arguments: `stop` one string or several (empty ones dropped)."""
        stops = tuple(s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s)
        return cls(temperature, top_p, top_k, seed, stops)


@dataclass
class Sequence:
    index: int  # its place in the caller's prompt list
    ids: list  # prompt token ids
    max_tokens: int
    caches: list  # one LayerKV per layer
    detok: object  # the tokenizer's StreamDecoder
    rng: np.random.Generator
    prefilled: int = 0  # prompt tokens already in the caches
    tokens: list = field(default_factory=list)  # sampled, the final EOS included
    text: str = ""
    finish_reason: str | None = None
    ended_on_eos: bool = False
    reported: bool = False  # handed to the caller's on_done
    emitted: int = 0  # characters of text handed out by delta()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> int:
        """Tokens generated, an ending EOS not counted (as GenerationSummary.generated_tokens)."""
        return len(self.tokens) - self.ended_on_eos

    def take(self, logits: np.ndarray, opts: SamplingOptions, eos_ids) -> int:
        """Sample the next token from this sequence's logits [vocab] and account for it; returns it."""
        token = sample(logits, opts.temperature, opts.top_p, opts.top_k, self.rng)
        self.tokens.append(token)
        if token in eos_ids:
            self.text += self.detok.finalize()
            self.finish_reason, self.ended_on_eos = "stop", True
        else:
            self.text += self.detok.add_token(token)
        hits = [i for i in (self.text.find(s) for s in opts.stop) if i >= 0]
        if hits:
            self.text, self.finish_reason = self.text[:min(hits)], "stop"
        elif self.finish_reason is None and len(self.tokens) == self.max_tokens:
            self.text += self.detok.finalize()
            self.finish_reason = "length"
        return token

    def delta(self, opts: SamplingOptions) -> str:
        """The text made since the last delta, less a tail that may still turn out to start a stop
        string (all of it once the sequence is done): what a stream shows after each token."""
        safe = len(self.text) if self.done else len(self.text) - partial_stop(self.text, list(opts.stop))
        out = self.text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return out
