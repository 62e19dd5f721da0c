"""Conversations on a model split across ranks (service/sequences.py's protocol): one sequence's
caches per conversation, held on every rank, trimmed and prefilled on every rank. (The Service's
chunked, swappable KV lives in one process.)
"""

from __future__ import annotations

from ..errors import MemoryBudgetError
from ..models.cache import KVCache
from ..service.sequences import Conversation, SequenceConversations
from .pipeline import Pipeline


class PipelineConversations(SequenceConversations):
    def __init__(self, engine):
        if not isinstance(engine.runner, Pipeline):
            raise ValueError("PipelineConversations is for an engine split across ranks")
        super().__init__(engine)
        self.most_together = 0  # the most calls one decode step ran (the server's continuous batch)

    @property
    def max_tokens(self) -> int:
        """Most tokens one conversation may hold: what every rank's plan holds KV for."""
        return min([self.engine.context_limit] + list(self.engine.runner.kv_tokens or []))

    def _new_caches(self) -> list:
        return self.engine.new_caches(self.max_tokens)

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

    def stats_sections(self) -> dict:
        """The /v1/stats sections of this service: its conversations, calls and the ranks."""
        p = self.engine.runner
        return {
            **super().stats_sections(),
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


def _buffer_tokens(tokens: int, most: int) -> int:
    """Tokens a cache's buffers hold once it has held `tokens`: KVCache grows in steps, never past `most`."""
    return min(most, -(-tokens // KVCache.step) * KVCache.step) if tokens else 0
