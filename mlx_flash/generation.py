"""What a generation takes and gives back, shared by every way of running one: the prompt checked and
encoded (a raw string, or chat messages through the model's chat template), and the records of its
tokens (a GenerationStep per token with its TokenStats, the GenerationSummary of the whole). The
single-sequence loop (engine.py), the server's continuous batch (service/) and a pipeline's calls
(distributed/) all take and make these."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError
from .sampling import shown


@dataclass
class TokenStats:
    """Per-token timing. io/mem are the FFN bundle reads and their decoding into backend arrays
    (zero with resident FFN weights); compute is the rest of the step."""

    wall_ms: float = 0.0
    compute_ms: float = 0.0
    io_ms: float = 0.0
    mem_ms: float = 0.0
    bytes_read: int = 0
    reads: int = 0


@dataclass
class GenerationStep:
    text: str  # the new text this token completes (may be "" while a character is incomplete)
    token: int
    stats: TokenStats
    finish_reason: str | None = None  # "stop" (EOS or stop string) / "length" on the last step


@dataclass
class GenerationSummary:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's tokens, those whose KV the caches already held
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_proposed: int = 0  # speculative decoding: draft tokens verified, and how many were kept
    draft_accepted: int = 0
    steps: list[TokenStats] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # every token sampled, the final EOS included

    @property
    def prefill_tps(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s else 0.0


def prompt_ids(tokenizer, prompt) -> list[int]:
    """A prompt's token ids: a string is a raw completion, a non-empty list of {'role', 'content'}
    messages goes through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return tokenizer.encode(unicode_text("the prompt", prompt))
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return tokenizer.apply_chat_template([_message(k, m) for k, m in enumerate(prompt)])
    raise ConfigError(
        f"prompt must be a string or a non-empty list of {{'role', 'content'}} messages (got {shown(prompt)})"
    )


def unicode_text(what: str, text: str) -> str:
    """`text` if it can be encoded: a lone surrogate (from undecodable bytes) cannot, and the
    tokenizer would fail on it with a type error that does not name it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid Unicode text (a lone surrogate at character {e.start})") from None
    return text


def _message(k: int, m: dict) -> dict:
    """Chat message k checked: string 'role' and 'content' (what a chat template renders)."""
    for key in ("role", "content"):
        if key not in m:
            raise ConfigError(f"each chat message needs 'role' and 'content' (message {k} has no {key!r})")
        if not isinstance(m[key], str):
            raise ConfigError(f"message {k}: {key!r} must be a string (got {shown(m[key])})")
        unicode_text(f"message {k} {key!r}", m[key])
    return m
