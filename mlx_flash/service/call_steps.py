"""The steps of a service call, which Service.call and the server's running batch (running_batch.py)
both take: prepare (checks and tokens, before anything changes), new_report, open_call (pin the
context, keep the KV of the longest common prefix, make room) and close_call (the context holds the
call's tokens, its record is written, it is unpinned)."""

from __future__ import annotations

import sys
import time

import numpy as np

from ..generation import unicode_text
from ..errors import ConfigError, ContextLengthError
from ..sampling import check_int, check_sampling
from .context import Context
from .lookup import common_prefix
from .reports import CallReport
from .swap_files import SwapError


class CallSteps:
    """Service's call steps (its base class): they use the service's engine, kv (kv_memory.KVMemory),
    pool, shape, _stats, get and _save."""

    def prepare(
        self,
        ctx_id: str,
        prompt,
        owner: str,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        whole: bool,
    ) -> tuple[Context, list[int], list | None]:
        """A call's checks and tokens: (the context, the call's whole token sequence, the chat
        history it makes, None for a raw completion). Raises before anything changes."""
        ctx = self.get(ctx_id, owner)
        if ctx.pinned:
            raise ConfigError(f"context {ctx_id} is in use")
        check_sampling(temperature, top_p, top_k)
        check_int("max_tokens", max_tokens, low=0)
        history = None
        if isinstance(prompt, str):
            base = [] if whole else ctx.sequence
            ids = base + self.engine.tokenizer.encode(unicode_text("the prompt", prompt), add_special_tokens=not base)
        else:
            history = ([] if whole else ctx.messages) + list(_messages(prompt))
            ids = self.engine.encode_prompt(history)
        if not ids:
            raise ConfigError("the prompt encodes to zero tokens")
        limit = self.max_tokens
        if len(ids) >= limit:
            raise ContextLengthError(
                f"the context would hold {len(ids)} tokens; a context holds fewer than {limit} "
                f"(the model's context {self.engine.model_context}, the KV budget "
                f"{self.pool.capacity_tokens} tokens)"
                + (f"; {disk}" if (disk := self.engine.disk_shortage(limit)) else "")
            )
        return ctx, ids, history

    @property
    def max_tokens(self) -> int:
        """Most tokens one context may hold: the model's context or the whole KV budget."""
        return min(self.engine.model_context, self.pool.capacity_tokens)

    def new_report(self, ctx: Context, ids: list[int]) -> CallReport:
        return CallReport(context=ctx.id, prompt_tokens=len(ids), moves_before=self.kv.counts.copy())

    def open_call(self, ctx: Context, ids: list[int], report: CallReport) -> list:
        """Pin the context, bring back the KV of its longest common prefix with ids, forget the rest,
        make room for the call's first chunks; returns the caches to run ids on (holding that
        prefix). `report` gets the switch."""
        t0 = time.perf_counter()
        n = min(common_prefix(ids, ctx.held()), len(ids) - 1)
        ctx.pinned = True
        try:
            report.restore = self.kv.restore(ctx, n)
            ctx.table.truncate(n)
            ctx.mark_changed(n)
            ctx.sequence = ctx.sequence[:n]
            need = ctx.table.chunks_for(len(ids) + 1) - len(ctx.table.slots)
            if self.pool.arena is not None:  # the first prefill piece: the rest claims as it goes (kv_memory.claim)
                need = min(need, ctx.table.chunks_for(n + self.engine.config.prefill_chunk + 1) - len(ctx.table.slots))
            self.kv.make_room(need, ctx.owner)
        except BaseException:
            ctx.pinned = False
            raise
        report.cached_tokens = n
        report.switch_s = time.perf_counter() - t0
        return ctx.table.caches()

    def close_call(
        self, ctx: Context, ids: list[int], history, caches, summary, text: str, failed: bool, report: CallReport
    ) -> None:
        """After a call (caches None: it failed before them): the context holds ids and every sampled
        token but the last (summary.tokens), the chat gains the answer unless the call failed, the
        record is written, the context unpinned."""
        if caches is not None:
            sampled = summary.tokens
            ctx.sequence = ids + sampled
            ctx.table.tokens = min(caches[0].offset, len(ids) + max(0, len(sampled) - 1))
            ctx.table.truncate(ctx.table.tokens)
            ctx.mark_changed(report.cached_tokens)
            self.kv.compress(ctx)  # (with compression on: its complete chunks to the arena, at their width)
            if history is not None and not failed:
                ctx.messages = history + [{"role": "assistant", "content": text}]
            self._count_call(report)
            if summary.prefill_s > 0:  # a measured prefill is what a recompute costs; a decode step, a pass
                step = float(np.median([t.wall_ms for t in summary.steps[1:]])) / 1e3 if len(summary.steps) > 1 else 0
                self.kv.costs.update(summary.prefill_s, summary.prompt_tokens - summary.cached_tokens, 0.0, 0, step)
        before = report.moves_before
        report.evicted_chunks = self.kv.counts.evicted - before.evicted
        report.written_chunks = self.kv.counts.written - before.written
        ctx.last_used = time.monotonic()
        ctx.pinned = False
        ok = sys.exc_info()[0] is None
        try:
            self._save(ctx)
        except SwapError:
            if ok:
                raise  # else the error already on its way (naming the file that failed first) is the one

    def _count_call(self, report: CallReport) -> None:
        s = self._stats
        s.calls += 1
        s.cache_hits += report.cached_tokens > 0
        s.prompt_tokens += report.prompt_tokens
        s.cached_tokens += report.cached_tokens


def _messages(prompt) -> list[dict]:
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ConfigError("prompt must be a string or a non-empty list of {'role', 'content'} messages")
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError("each message must be a {'role': str, 'content': str} object")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]
