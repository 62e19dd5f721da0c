"""LLMS: the engine as a service holding many app contexts (paper §3-§4).

    svc = mlx_flash.Service(engine, directory=..., kv_budget="500MB")
    ctx = svc.new_context(system="You are terse.")
    for step in svc.call(ctx, [{"role": "user", "content": "What is the capital of France?"}]):
        print(step.text, end="")                                      # (a str: a raw completion)
    svc.delete(ctx)

A context's KV lives in chunks of C tokens (chunk_pool.py) drawn from one pool of `kv_budget`
bytes; a call prefills only what the context does not hold yet (the longest common prefix of the
call's tokens and the held ones is kept). When the pool is full, chunks of the least recently used
contexts are swapped to the service directory (lifecycle.py); a call on a swapped context brings
them back by reading and recomputing at once (restore.py). Idle time writes chunks ahead
(swap_out_idle), so a later eviction only frees memory. Every context's record is on flash after
each call, so the directory is the service's state across restarts.

One service runs on one thread at a time (the server queues requests onto one worker).
"""

from __future__ import annotations

import hashlib
import os
import secrets

from typing import Iterator

import numpy as np

from ..budget import parse_budget
from ..config import FFNMode, default_cache_dir
from ..generation import GenerationStep
from ..errors import ConfigError, MemoryBudgetError
from ..memory import process_rss
from ..sampling import check_generation
from ..units import fmt
from .call_steps import CallSteps
from .chunk_pool import ChunkPool, ChunkShape
from .chunked_kv import ChunkTable
from .compression import Compression, DensityTracker
from .context import Context
from .kv_memory import KVMemory
from .lifecycle import Lifecycle, Restore
from .lookup import common_prefix, owned
from .quota import KeyQuota
from .reports import CallReport, ServiceStats
from .restore import RestoreReport
from .swap_files import SwapDir

DEFAULT_CHUNK = 16
FLOAT_SHARE = 4  # with compression on, 1 / FLOAT_SHARE of the KV budget holds float chunks, the rest codes


class Service(CallSteps):
    def __init__(
        self,
        engine,
        directory: str | None = None,
        kv_budget=None,
        chunk_tokens: int = DEFAULT_CHUNK,
        kv_compression: str | None = None,
        reader_threads: int = 4,
        max_contexts: int = 1024,
        lifecycle: Lifecycle = Lifecycle(),
        progress: bool = False,
        key_quota: KeyQuota = KeyQuota(),
    ):
        self.compression = Compression.parse(kv_compression)
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be a positive integer (got {chunk_tokens!r})")
        self.engine = engine
        a = engine.args
        self.shape = ChunkShape(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, chunk_tokens)
        self.model_id = _model_id(engine.store.path)
        self.directory = directory or os.path.join(
            engine.config.cache_dir or default_cache_dir(), "service", self.model_id
        )
        self.kv_budget, grows = self._budget(kv_budget)
        slot_bytes = self.shape.nbytes * engine.ops.array(np.zeros(1, np.float32)).nbytes // 4  # activation dtype
        self.swap = SwapDir(self.directory)
        self.max_contexts = max_contexts
        self.key_quota = key_quota
        self.contexts: dict[str, Context] = {}
        # Compression holds complete chunks in an arena at their width; float slots are left for the
        # chunks being written (a call's new tokens: a longer call moves its written chunks to the
        # arena as it goes, kv_memory.claim): a quarter of the budget.
        float_bytes = self.kv_budget // FLOAT_SHARE if self.compression.on else self.kv_budget
        n_float = float_bytes // slot_bytes
        self.kv = KVMemory(
            engine,
            ChunkPool(
                engine.ops,
                self.shape,
                n_float,
                grows,
                max(0, self.kv_budget - n_float * slot_bytes) if self.compression.on else 0,
            ),
            self.swap,
            self.compression,
            lifecycle,
            self.contexts,
            self._save,
            reader_threads,
            key_quota,
        )
        self.pool = self.kv.pool
        self.last = CallReport()
        self._stats = ServiceStats(self.kv_budget, chunk_tokens, slot_bytes, self.pool.n_slots, 0, 0, 0, 0)
        self.problems = self._load_records()
        if progress:
            print(
                f"service: {len(self.contexts)} contexts in {self.directory}; KV budget {fmt(self.kv_budget)} = "
                f"{self.pool.n_slots} chunks of {chunk_tokens} tokens",
                flush=True,
            )

    # ---- budget and records ----------------------------------------------------------------------
    def _budget(self, kv_budget) -> tuple[int, bool]:
        """Bytes of the pool: kv_budget (bytes, or a share of the process's memory limit), or the KV
        share the memory plan set aside; never more than the limit leaves (measured now). And whether
        the pool may grow as it fills (chunk_pool.py): where the weights are all held already (resident,
        none streamed) and the limit leaves room for the pool and the copy of its last growth. Streamed
        weights fill their caches later, so their room now is not room then: there the pool is whole
        from the start."""
        plan = self.engine.memory_plan
        limit = plan.get("limit")
        room = limit - process_rss() - plan.get("work_buffers", 0) if limit else None
        if kv_budget is None:
            want = plan.get("kv_cache") or 64 * self.shape.nbytes
            want = min(want, room) if room is not None else want
        else:
            want = parse_budget(kv_budget, limit or 0, "KV budget")
            if room is not None and want > room:
                raise MemoryBudgetError(
                    f"KV budget {fmt(want)} is more than the memory limit leaves ({fmt(room)} of "
                    f"{fmt(limit)} with the model loaded)"
                )
        held = self.engine.config.ffn is FFNMode.RESIDENT and not plan.get("streamed_layers")
        return want, held and (room is None or room >= want * 5 // 4)

    def _load_records(self) -> list[str]:
        records, problems = self.swap.records()
        for ctx_id, rec in records.items():
            try:
                self.contexts[ctx_id] = Context.from_record(rec, self._table(str(rec.get("owner", ""))), self.model_id)
            except (ValueError, KeyError, TypeError) as e:
                problems.append(f"context {ctx_id}: {e}")
        return problems

    def _table(self, owner: str) -> ChunkTable:
        """A context's chunk list, its slots claimed for `owner` (quota.py)."""
        table = ChunkTable(self.pool, None, DensityTracker() if self.compression.needs_density else None)
        table.claim = lambda: self.kv.claim(owner, table)
        return table

    def _save(self, ctx: Context) -> None:
        self.swap.write_record(ctx.id, ctx.record(self.model_id))

    # ---- contexts ---------------------------------------------------------------------------------
    def new_context(self, system: str | None = None, owner: str = "") -> str:
        """A new, empty context (with a system message for chat calls); returns its id."""
        if system is not None and not isinstance(system, str):
            raise ConfigError("system must be a string")
        self._room_for_context(owner)
        ctx = Context(
            id=secrets.token_urlsafe(18),
            owner=owner,
            table=self._table(owner),
            messages=[{"role": "system", "content": system}] if system else [],
        )
        self._add(ctx)
        return ctx.id

    def _add(self, ctx: Context) -> None:
        """Hold a new context once its record is on flash: one held without (a full disk) would keep
        chunks that only a write to that disk could evict."""
        self.contexts[ctx.id] = ctx
        try:
            self._save(ctx)
        except BaseException:
            del self.contexts[ctx.id]
            ctx.table.truncate(0)
            self.swap.remove(ctx.id)
            raise

    def _room_for_context(self, owner: str) -> None:
        """Room for one more context of `owner`: at its key's quota, its own least recently used idle
        context is deleted; at max_contexts, the least recently used idle one of its own or of a key
        over its quota (any key's without quotas): a stateless client starts a context per
        conversation, and nothing else would remove them."""
        q = self.key_quota
        while True:
            count: dict[str, int] = {}
            for c in self.contexts.values():
                count[c.owner] = count.get(c.owner, 0) + 1
            if q.over_contexts(count.get(owner, 0) + 1):
                who, what = {owner}, f"this key's {count.get(owner, 0)} contexts (its quota)"
            elif len(self.contexts) >= self.max_contexts:
                who = {o for o, n in count.items() if o == owner or q.contexts is None or q.over_contexts(n)}
                what = f"all {len(self.contexts)} contexts"
            else:
                return
            idle = [c for c in self.contexts.values() if not c.pinned and c.owner in who]
            if not idle:
                raise MemoryBudgetError(f"{what} are in use")
            old = min(idle, key=lambda c: c.last_used)
            self.delete(old.id, old.owner)

    def get(self, ctx_id: str, owner: str = "") -> Context:
        return owned(self.contexts, ctx_id, owner)

    def list(self, owner: str = "") -> list[dict]:
        return [self.describe(c) for c in self.contexts.values() if c.owner == owner]

    def describe(self, ctx: Context) -> dict:
        mem = ctx.chunks_in_memory()
        return {
            "id": ctx.id,
            "tokens": ctx.kv_tokens,
            "messages": len(ctx.messages),
            "chunks": len(ctx.table.slots),
            "chunks_in_memory": len(mem),
        }

    def delete(self, ctx_id: str, owner: str = "") -> None:
        ctx = self.get(ctx_id, owner)
        if ctx.pinned:
            raise ConfigError(f"context {ctx_id} is in use")
        ctx.table.truncate(0)
        del self.contexts[ctx.id]
        self.swap.remove(ctx.id)

    def fork(self, ctx_id: str, n_tokens: int, owner: str = "") -> str:
        """A new context holding the first n_tokens of ctx's KV, sharing its chunks copy-on-write
        (chunks on flash are read back first)."""
        src = self.get(ctx_id, owner)
        n_tokens = min(n_tokens, src.kv_tokens)
        src.pinned = True
        try:
            self.kv.restore(src, n_tokens)
        finally:
            src.pinned = False
        self._room_for_context(owner)
        dst = Context(
            id=secrets.token_urlsafe(18), owner=owner, table=self._table(owner), sequence=src.sequence[:n_tokens]
        )
        dst.table.slots = [self.pool.share(s) for s in src.table.slots[: src.table.chunks_for(n_tokens)]]
        dst.table.tokens = n_tokens
        dst.mark_changed(0)
        dst.widths = [self.pool.width(s) for s in dst.table.slots]  # shared compressed chunks stay so
        self._add(dst)
        return dst.id

    def match(self, ids: list[int], owner: str = "") -> tuple[str | None, int]:
        """The owner's context sharing the longest token prefix with ids, and its length in whole
        chunks (a stateless client re-sending a growing history finds its conversation here)."""
        best, best_n = None, 0
        for ctx in self.contexts.values():
            if ctx.owner != owner or ctx.pinned:
                continue
            n = common_prefix(ids, ctx.held())
            if n > best_n or (n == best_n and best is not None and ctx.last_used > best.last_used):
                best, best_n = ctx, n
        if best is None:
            return None, 0
        if best_n < best.kv_tokens:  # a shared part only: whole chunks are worth a fork
            best_n = best_n // self.shape.tokens * self.shape.tokens
        return (best.id, best_n) if best_n else (None, 0)

    # ---- calls --------------------------------------------------------------------------------
    def call(
        self,
        ctx_id: str,
        prompt,
        owner: str = "",
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop=None,
        speculative: int = 0,
        whole: bool = False,
    ) -> Iterator[GenerationStep]:
        """Stream the answer to `prompt` in context ctx_id, appending both to it. A str prompt
        continues the context's text as a raw completion; a list of messages is appended to its
        chat and the whole chat goes through the chat template. whole=True: `prompt` is the whole
        text or chat instead (a stateless client's request). Only the tokens the context does not
        hold are prefilled. Errors in the arguments raise before the first step."""
        check_generation(max_tokens, temperature, top_p, top_k, seed, stop, speculative)
        ctx, ids, history = self.prepare(ctx_id, prompt, owner, max_tokens, temperature, top_p, top_k, whole)
        sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        return self._run(ctx, ids, history, dict(sampling, seed=seed, stop=stop, speculative=speculative))

    def _run(self, ctx: Context, ids: list[int], history, sampling: dict) -> Iterator[GenerationStep]:
        caches, text, failed = None, [], True
        report = self.last = self.new_report(ctx, ids)
        try:
            caches = self.open_call(ctx, ids, report)
            steps = self.engine.stream_tokens(ids, caches, **sampling)
            try:
                for step in steps:
                    text.append(step.text)
                    yield step
                failed = False
            except GeneratorExit:  # the caller closing the stream early is no failure
                failed = False
                raise
        finally:
            self.close_call(ctx, ids, history, caches, self.engine.last, "".join(text), failed, report)

    # ---- where chunks live (kv_memory.py) --------------------------------------------------------
    def bring_back(self, ctx_id: str, how: Restore | str | None = None, owner: str = "") -> RestoreReport:
        """Bring every chunk of a context into memory now: how = None (the lifecycle's way, by default
        reading and recomputing at once), "read" or "recompute" only."""
        try:
            how = Restore(how) if how is not None else None
        except ValueError:
            raise ConfigError(f"how {how!r} is not one of: {', '.join(r.value for r in Restore)}") from None
        ctx = self.get(ctx_id, owner)
        ctx.pinned = True
        try:
            return self.kv.restore(ctx, ctx.kv_tokens, how)
        finally:
            ctx.pinned = False

    def swap_out(self, ctx_id: str, owner: str = "") -> int:
        """Move a context's chunks to flash now; returns how many slots that freed."""
        return self.kv.swap_out(self.get(ctx_id, owner))

    def swap_out_idle(self, max_chunks: int = 16) -> int:
        """Ahead-of-time swap-out (LLMS §3.4): write up to max_chunks chunks that have no current
        swap file, keeping them in memory, so evicting them later costs no I/O. Call it when idle;
        returns how many were written (0: nothing left to write)."""
        return self.kv.swap_out_idle(max_chunks)

    def flush(self) -> None:
        """Write every chunk without a current swap file (before a shutdown)."""
        self.kv.flush()

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> ServiceStats:
        s, m = self._stats, self.kv.counts
        s.chunks_written, s.chunks_read, s.chunks_recomputed = m.written, m.read, m.recomputed
        s.bad_swap_files = m.bad_files
        s.slots_free = self.pool.free_slots
        arena = self.pool.arena
        s.coded_bytes, s.coded_bytes_used = (arena.nbytes, arena.used_bytes) if arena else (0, 0)
        s.contexts = len(self.contexts)
        s.contexts_resident = sum(c.table.resident() for c in self.contexts.values())
        s.contexts_swapped = s.contexts - s.contexts_resident
        return s

    def stats_sections(self) -> dict:
        """The /v1/stats sections of this service (the server adds memory and queue)."""
        s = self.stats()
        return {
            "memory": {"kv_budget": s.kv_budget},
            "contexts": {"total": s.contexts, "resident": s.contexts_resident, "swapped": s.contexts_swapped},
            "kv": {
                "chunk_tokens": s.chunk_tokens,
                "chunk_bytes": s.chunk_bytes,
                "slots": s.slots,
                "slots_free": s.slots_free,
                "compressed_bytes": s.coded_bytes,
                "compressed_bytes_used": s.coded_bytes_used,
                "chunks_written": s.chunks_written,
                "chunks_read": s.chunks_read,
                "chunks_recomputed": s.chunks_recomputed,
                "bad_swap_files": s.bad_swap_files,
            },
            "calls": {
                "total": s.calls,
                "cache_hits": s.cache_hits,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
            },
        }

    def close(self) -> None:
        self.kv.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _model_id(store_path: str) -> str:
    """Contexts belong to one model: a digest of its store's manifest."""
    with open(os.path.join(store_path, "manifest.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]
