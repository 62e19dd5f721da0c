"""The chat's conversations on a model split across ranks: the part of the Service protocol the REPL
uses (new_context, get(id).messages, call, delete, max_tokens, engine), over one sequence's caches
per conversation, held on every rank (the Service's chunked, swappable KV lives in one process).

A call continues its conversation's caches: the tokens they hold that the new prompt starts with
stay, the rest is trimmed on every rank (a re-tokenized answer may differ from the sampled tokens),
and only the new tokens are prefilled.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import ConfigError, ContextNotFoundError


@dataclass
class Conversation:
    caches: list
    messages: list = field(default_factory=list)
    held: list = field(default_factory=list)  # the token ids the caches hold, on every rank


class PipelineConversations:
    def __init__(self, engine):
        if engine.pipeline is None:
            raise ValueError("PipelineConversations is for an engine split across ranks")
        self.engine = engine
        self.contexts: dict[str, Conversation] = {}
        self._ids = itertools.count(1)

    @property
    def max_tokens(self) -> int:
        """Most tokens one conversation may hold: what every rank's plan holds KV for."""
        return min([self.engine.context_limit] + list(self.engine.pipeline.kv_tokens or []))

    def new_context(self, system: str | None = None) -> str:
        ctx = f"conversation-{next(self._ids)}"
        self.contexts[ctx] = Conversation(self.engine.new_caches(self.max_tokens),
                                          [{"role": "system", "content": system}] if system else [])
        return ctx

    def get(self, ctx: str) -> Conversation:
        if ctx not in self.contexts:
            raise ContextNotFoundError(f"no conversation {ctx!r}")
        return self.contexts[ctx]

    def delete(self, ctx: str) -> None:
        self.engine.pipeline.free(self.get(ctx).caches)
        del self.contexts[ctx]

    def call(self, ctx: str, prompt: list, whole: bool = False, **sampling) -> Iterator:
        """Stream the answer to the messages `prompt` appended to the conversation (whole: `prompt`
        is the whole chat instead); the conversation gains both once the answer is done."""
        c = self.get(ctx)
        if not isinstance(prompt, list):
            raise ConfigError("a pipelined conversation takes chat messages")
        history = (prompt if whole else c.messages + prompt)
        ids = self.engine.encode_prompt(history)
        if len(ids) >= self.max_tokens:
            raise ConfigError(f"the conversation would hold {len(ids)} tokens; it holds fewer than {self.max_tokens}")
        keep = 0
        while keep < min(len(ids) - 1, len(c.held)) and ids[keep] == c.held[keep]:
            keep += 1
        if keep < c.caches[0].offset:
            self.engine.pipeline.trim(c.caches, keep)
        c.held = c.held[:keep]
        return self._run(c, ids, history, sampling)

    def _run(self, c: Conversation, ids: list, history: list, sampling: dict) -> Iterator:
        text = []
        for step in self.engine.stream_tokens(ids, c.caches, **sampling):
            text.append(step.text)
            yield step
        c.held = ids + self.engine.last.tokens[:-1]  # (the caches hold every sampled token but the last)
        c.messages = history + [{"role": "assistant", "content": "".join(text)}]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for ctx in list(self.contexts):
            try:
                self.delete(ctx)
            except Exception:  # noqa: BLE001 - a broken pipeline has nobody to tell
                break
