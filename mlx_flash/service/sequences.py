"""Conversations that each hold one sequence's caches (engine.new_caches): the part of the Service
protocol the chat's REPL and the server use (new_context, get, list, describe, delete, match, call,
stats_sections, max_tokens, engine). The Service's chunked, swappable KV serves many contexts in one
process; these hold whole sequences, for what that pool cannot:

  distributed/conversations.PipelineConversations  a model split across ranks: each conversation's
                                                   KV on every rank
  TieredConversations                              one process whose plan keeps a long sequence's
                                                   older KV on flash (models/kv_tiers.py): the chat's
                                                   conversation holds the model's whole context

A call continues its conversation's caches: the tokens they hold that the new prompt starts with
stay, the rest is trimmed (a re-tokenized answer may differ from the sampled tokens), and only the
new tokens are prefilled. A chat call takes messages (appended to the conversation's, or the whole
chat with whole=True); a completion call takes text (continuing the conversation's tokens, or the
whole text). Members say how many tokens a conversation may hold (max_tokens), make room for a
call's KV (make_room) and make a new conversation's caches (_new_caches).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import ConfigError, ContextLengthError, MemoryBudgetError
from ..generation import unicode_text
from .lookup import common_prefix, owned


@dataclass
class Conversation:
    id: str
    owner: str
    caches: list | None  # None: none held (TieredConversations makes them at a call)
    messages: list = field(default_factory=list)
    sequence: list = field(default_factory=list)  # every token of it: prompts and sampled ones
    held: list = field(default_factory=list)  # the token ids the caches hold (on every rank of a pipeline)
    busy: bool = False
    used: int = 0  # when a call last began (the least recently used idle conversation's KV goes first)
    reserved: int = 0  # tokens of KV the running call may fill


class SequenceConversations(ABC):
    """Conversations of one sequence's caches each (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.problems: list[str] = []  # (a Service's contexts read back from disk that failed: none here)
        self.contexts: dict[str, Conversation] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.evicted = 0  # conversations whose KV was dropped to make room (each prefills again when next used)
        self.calls = self.cached_tokens = self.prompt_tokens = 0

    @property
    @abstractmethod
    def max_tokens(self) -> int:
        """Most tokens one conversation may hold."""

    @abstractmethod
    def make_room(self, c: Conversation, tokens: int) -> None:
        """Make room for `tokens` tokens of conversation c's KV (c.caches hold them after), dropping
        idle conversations' KV where needed, else MemoryBudgetError."""

    @abstractmethod
    def _new_caches(self) -> list | None:
        """A new conversation's caches (None: made when it is first called)."""

    def new_context(self, system: str | None = None, owner: str = "") -> str:
        if system is not None and not isinstance(system, str):
            raise ConfigError("system must be a string")
        ctx = f"conversation-{next(self._ids)}"
        self.contexts[ctx] = Conversation(
            ctx, owner, self._new_caches(), [{"role": "system", "content": system}] if system else []
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
        if c.caches is not None:
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
            disk = self.engine.disk_shortage(self.max_tokens)
            raise ContextLengthError(
                f"the context would hold {len(ids)} tokens; a context holds fewer than {self.max_tokens}"
                + (f" ({disk})" if disk else "")
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
        """The /v1/stats sections: the conversations and the calls."""
        return {
            "contexts": {"total": len(self.contexts), "kv_dropped": self.evicted},
            "calls": {"total": self.calls, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens},
        }

    def close(self) -> None:
        for ctx in list(self.contexts):
            self.contexts[ctx].busy = False
            self.delete(ctx, self.contexts[ctx].owner)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TieredConversations(SequenceConversations):
    """Conversations of one process whose plan holds a sequence longer than its KV share (KV tiers):
    a conversation's caches are made at its first call and hold the whole context, its window
    resident and its older tokens on flash; one conversation at a time holds them (the window and
    the read buffers are planned for one sequence), the others' dropped while idle and prefilled
    again when next called."""

    @property
    def max_tokens(self) -> int:
        return self.engine.context_limit

    def _new_caches(self) -> None:
        return None

    def make_room(self, c: Conversation, tokens: int) -> None:
        c.reserved, c.used = tokens, next(self._clock)
        for o in self.contexts.values():
            if o is c or o.caches is None:
                continue
            if o.busy:
                raise MemoryBudgetError(
                    f"context {o.id} is answering; the memory plan holds one conversation longer than its "
                    "KV share at a time"
                )
            self.engine.release(o.caches)
            o.caches, o.held = None, []
            self.evicted += 1
        if c.caches is None:
            c.caches, c.held = self.engine.new_caches(self.max_tokens), []
