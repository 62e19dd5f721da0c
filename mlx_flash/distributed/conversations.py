"""Conversations on a model split across ranks: the part of the Service protocol the chat's REPL and
the server use (new_context, get, list, describe, delete, match, call, stats_sections, max_tokens,
engine), over one sequence's caches per conversation, held on every rank. (The Service's chunked,
swappable KV lives in one process.)

A call continues its conversation's caches: the tokens they hold that the new prompt starts with
stay, the rest is trimmed on every rank (a re-tokenized answer may differ from the sampled tokens),
and only the new tokens are prefilled. A chat call takes messages (appended to the conversation's,
or the whole chat with whole=True); a completion call takes text (continuing the conversation's
tokens, or the whole text).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import ConfigError, ContextLengthError, MemoryBudgetError
from ..generation import unicode_text
from ..models.cache import KVCache
from ..service.lookup import common_prefix, owned
from .pipeline import Pipeline


@dataclass
class Conversation:
    id: str
    owner: str
    caches: list
    messages: list = field(default_factory=list)
    sequence: list = field(default_factory=list)  # every token of it: prompts and sampled ones
    held: list = field(default_factory=list)  # the token ids the caches hold, on every rank
    busy: bool = False
    used: int = 0  # when a call last began (the least recently used idle conversation's KV goes first)
    reserved: int = 0  # tokens of KV the running call may fill


class PipelineConversations:
    def __init__(self, engine):
        if not isinstance(engine.runner, Pipeline):
            raise ValueError("PipelineConversations is for an engine split across ranks")
        self.engine = engine
        self.problems: list[str] = []  # (a Service's contexts read back from disk that failed: none here)
        self.contexts: dict[str, Conversation] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.evicted = 0  # conversations whose KV was dropped to make room (each prefills again when next used)
        self.most_together = 0  # the most calls one decode step ran (the server's continuous batch)
        self.calls = self.cached_tokens = self.prompt_tokens = 0

    @property
    def max_tokens(self) -> int:
        """Most tokens one conversation may hold: what every rank's plan holds KV for."""
        return min([self.engine.context_limit] + list(self.engine.runner.kv_tokens or []))

    def new_context(self, system: str | None = None, owner: str = "") -> str:
        if system is not None and not isinstance(system, str):
            raise ConfigError("system must be a string")
        ctx = f"conversation-{next(self._ids)}"
        self.contexts[ctx] = Conversation(
            ctx,
            owner,
            self.engine.new_caches(self.max_tokens),
            [{"role": "system", "content": system}] if system else [],
        )
        return ctx

    def get(self, ctx: str, owner: str = "") -> Conversation:
        return owned(self.contexts, ctx, owner)

    def list(self, owner: str = "") -> list[dict]:
        return [self.describe(c) for c in self.contexts.values() if c.owner == owner]

    def describe(self, c: Conversation) -> dict:
        return {"id": c.id, "tokens": len(c.held), "messages": len(c.messages)}

    def delete(self, ctx: str, owner: str = "") -> None:
        c = self.get(ctx, owner)
        if c.busy:
            raise ConfigError(f"context {ctx} is in use")
        self.engine.release(c.caches)
        del self.contexts[ctx]

    def match(self, ids: list[int], owner: str = "") -> str | None:
        """The owner's idle conversation whose held tokens share the longest prefix with ids (a
        stateless client re-sending a growing history finds its conversation), or None."""
        best, best_n = None, 0
        for c in self.contexts.values():
            if c.owner == owner and not c.busy:
                n = common_prefix(ids, c.held)
                if n > best_n:
                    best, best_n = c.id, n
        return best

    def call(self, ctx: str, prompt, owner: str = "", whole: bool = False, **sampling) -> Iterator:
        """Stream the answer to `prompt` in the conversation; it gains both once the answer is done.
        Errors in the arguments raise before the first step."""
        c, ids, history, _ = self.prepare(ctx, prompt, owner, whole, sampling.get("max_tokens", 256))
        return self._run(c, ids, history, sampling)

    def prepare(
        self, ctx: str, prompt, owner: str = "", whole: bool = False, max_new: int = 0
    ) -> tuple[Conversation, list, list | None, int]:
        """(the conversation, the prompt's ids, its chat history or None, the tokens its caches keep):
        the caches trimmed on every rank to what the prompt starts with; the rest is to prefill. Room
        for the prompt and `max_new` more tokens is made first (make_room)."""
        c = self.get(ctx, owner)
        if c.busy:
            raise ConfigError(f"context {ctx} is in use")
        history = None
        if isinstance(prompt, str):
            base = [] if whole else c.sequence
            ids = base + self.engine.tokenizer.encode(unicode_text("the prompt", prompt), add_special_tokens=not base)
        elif isinstance(prompt, list):
            history = prompt if whole else c.messages + prompt
            ids = self.engine.encode_prompt(history)
        else:
            raise ConfigError("a prompt is text or a list of chat messages")
        if not ids:
            raise ConfigError("the prompt encodes to zero tokens")
        if len(ids) >= self.max_tokens:
            raise ContextLengthError(
                f"the context would hold {len(ids)} tokens; a context holds fewer than {self.max_tokens}"
            )
        self.make_room(c, len(ids) + max_new)
        keep = min(common_prefix(ids, c.held), len(ids) - 1)
        if keep < c.caches[0].offset:
            self.engine.runner.trim(c.caches, keep)
        c.held = c.held[:keep]
        self.calls += 1
        self.prompt_tokens += len(ids)
        self.cached_tokens += keep
        return c, ids, history, keep

    def _run(self, c: Conversation, ids: list, history: list | None, sampling: dict) -> Iterator:
        text = []
        c.busy = True
        try:
            for step in self.engine.stream_tokens(ids, c.caches, **sampling):
                text.append(step.text)
                yield step
        finally:
            c.busy = False
        self.settle(c, ids, self.engine.last.tokens, history, "".join(text))

    def make_room(self, c: Conversation, tokens: int) -> None:
        """Reserve KV for `tokens` tokens of conversation c under every rank's plan (the least
        kv_tokens): every other conversation counts the buffers its caches hold (a running call, what
        it may still fill); the least recently used idle ones drop their KV on every rank (their
        messages stay: the next call prefills them again) until c fits, else MemoryBudgetError."""
        budget = self.max_tokens
        c.reserved = tokens
        c.used = next(self._clock)

        def held(o: Conversation) -> int:
            buffer = o.caches[0].keys.shape[2] if o.caches[0].keys is not None else 0  # (trimming keeps it)
            return max(buffer, _buffer_tokens(o.reserved, budget)) if o.busy or o is c else buffer

        others = [o for o in self.contexts.values() if o is not c]
        total = held(c) + sum(held(o) for o in others)
        for o in sorted((o for o in others if not o.busy and held(o)), key=lambda o: o.used):
            if total <= budget:
                break
            total -= held(o)
            self.engine.release(o.caches)
            o.caches, o.held = self.engine.new_caches(self.max_tokens), []
            self.evicted += 1
        if total > budget:
            raise MemoryBudgetError(
                f"the running conversations' KV and this call's ({tokens} tokens) need {total} "
                f"tokens; the ranks' memory plans hold {budget}: fewer requests at once, a smaller "
                "max_tokens, or more memory for the ranks"
            )

    def settle(self, c: Conversation, ids: list, sampled: list, history: list | None, text: str) -> None:
        """The conversation after an answer: its caches hold the prompt and every sampled token but
        the last."""
        c.held = ids + sampled[:-1]
        c.sequence = ids + sampled
        c.reserved = 0
        if history is not None:
            c.messages = history + [{"role": "assistant", "content": text}]

    def flush(self) -> None:
        """Nothing to write: the conversations live in the ranks' memory (the Service protocol's flush)."""

    def stats_sections(self) -> dict:
        """The /v1/stats sections of this service: its conversations, calls and the ranks."""
        p = self.engine.runner
        return {
            "contexts": {"total": len(self.contexts), "kv_dropped": self.evicted},
            "calls": {"total": self.calls, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens},
            "pipeline": {
                "ranks": p.t.size,
                "layers": [[s.start, s.stop] for s in p.stages],
                "kv_tokens": p.kv_tokens,
                "broken": p.broken,
                "most_decoded_together": self.most_together,
            },
        }

    def close(self) -> None:
        for ctx in list(self.contexts):
            if self.engine.runner.broken is not None:
                break  # a broken pipeline has nobody to tell
            self.contexts[ctx].busy = False
            self.delete(ctx, self.contexts[ctx].owner)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _buffer_tokens(tokens: int, most: int) -> int:
    """Tokens a cache's buffers hold once it has held `tokens`: KVCache grows in steps, never past `most`."""
    return min(most, -(-tokens // KVCache.step) * KVCache.step) if tokens else 0
