"""The LLMS trace benchmark (paper §4, §5.1): many contexts built from real text, called in the
paper's patterns with Poisson arrivals, under a KV budget that holds a share of their KV; LLMS
against the baselines and its ablations, each a Service (service/) with other options on the same
calls; `python -m mlx_flash.bench service` runs it.

Switching latency is the time from a call's arrival until its context is ready to prefill the
new tokens (making room, reading and recomputing chunks); time to first token adds that prefill
and the first decode step. Between two calls the service gets the arrival gap as idle time (spent
on ahead-of-time swap-out where the variant has it, never slept).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from ..service.chunk_pool import ChunkShape
from ..service.lifecycle import Evict, Lifecycle, Restore
from ..service.service import DEFAULT_CHUNK, FLOAT_SHARE, Service

PATTERNS = ("random", "markov", "gaussian")


@dataclass(frozen=True)
class Variant:
    name: str
    lifecycle: Lifecycle
    compression: str = "off"


VARIANTS = (
    Variant("LMK", Lifecycle(Evict.DROP, Restore.RECOMPUTE, ahead=False)),
    Variant("whole-context swap", Lifecycle(Evict.WHOLE_CONTEXT, Restore.READ, ahead=False)),
    Variant("vLLM-S", Lifecycle(Evict.CHUNKS, Restore.READ, ahead=False)),
    Variant("vLLM-SQ", Lifecycle(Evict.CHUNKS, Restore.READ, ahead=False), "static:8"),
    Variant("LLMS", Lifecycle(), "tolerance:0.5"),
    Variant("LLMS w/o compression", Lifecycle()),
    Variant("LLMS w/o pipeline", Lifecycle(restore=Restore.READ), "tolerance:0.5"),
    Variant("LLMS w/o ahead-of-time swap-out", Lifecycle(ahead=False), "tolerance:0.5"),
)


@dataclass
class TraceConfig:
    contexts: int = 16
    context_tokens: int = 512  # each context starts as this many tokens of one article
    calls: int = 48
    call_tokens: int = 32  # new text per call
    generate: int = 4
    mean_gap_s: float = 0.25  # Poisson arrivals
    kv_share: float = 0.25  # the KV budget, as a share of the contexts' KV at the start
    seed: int = 0


def call_sequence(pattern: str, n_contexts: int, n_calls: int, rng: np.random.Generator) -> list[int]:
    """Which context each call goes to. random: uniform. markov: a random transition matrix that
    stays with the same context or moves to a neighbour most of the time. gaussian: a normal
    around a slowly drifting centre."""
    if pattern == "random":
        return rng.integers(0, n_contexts, n_calls).tolist()
    if pattern == "markov":
        P = rng.random((n_contexts, n_contexts)) * 0.2
        for i in range(n_contexts):
            for d in (-1, 0, 1):
                P[i, (i + d) % n_contexts] += 1.0
        P /= P.sum(1, keepdims=True)
        seq = [int(rng.integers(n_contexts))]
        for _ in range(n_calls - 1):
            seq.append(int(rng.choice(n_contexts, p=P[seq[-1]])))
        return seq
    if pattern == "gaussian":
        centre, out = n_contexts / 2, []
        for _ in range(n_calls):
            centre = (centre + rng.normal(0, 0.5)) % n_contexts
            out.append(int(np.clip(np.rint(rng.normal(centre, n_contexts / 8)), 0, n_contexts - 1)))
        return out
    raise ConfigError(f"pattern {pattern!r} is unknown (choose one of: {', '.join(PATTERNS)})")


@dataclass
class TraceResult:
    variant: str
    pattern: str
    switch_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    chunks_read: int = 0
    chunks_recomputed: int = 0
    chunks_written: int = 0
    kv_budget: int = 0

    def summary(self) -> dict:
        return {
            "variant": self.variant,
            "kv_budget_mb": self.kv_budget / 1e6,
            "pattern": self.pattern,
            "calls": len(self.switch_s),
            "switch_mean_ms": 1e3 * float(np.mean(self.switch_s)),
            "switch_p50_ms": 1e3 * float(np.median(self.switch_s)),
            "ttft_mean_ms": 1e3 * float(np.mean(self.ttft_s)),
            "chunks_read": self.chunks_read,
            "chunks_recomputed": self.chunks_recomputed,
            "chunks_written": self.chunks_written,
        }


def build_texts(engine, corpus: str, cfg: TraceConfig) -> tuple[list[list[int]], list[list[int]]]:
    """Per context: its first tokens, and the pieces its calls append, cut from consecutive text."""
    ids = engine.tokenizer.encode(corpus)
    per = cfg.context_tokens + cfg.calls * cfg.call_tokens
    if len(ids) < cfg.contexts * cfg.context_tokens + cfg.call_tokens:
        raise ConfigError("the corpus is too short for this many contexts")
    starts, pieces = [], []
    for c in range(cfg.contexts):
        base = (c * per) % max(1, len(ids) - per)
        starts.append(ids[base : base + cfg.context_tokens])
        tail = ids[base + cfg.context_tokens : base + per]
        pieces.append([tail[k : k + cfg.call_tokens] for k in range(0, len(tail), cfg.call_tokens)])
    return starts, pieces


def trace_budget(engine, cfg: TraceConfig) -> int:
    """The KV budget every variant of a trace gets: `kv_share` of the contexts' float KV, and never less
    than a compressing variant needs to run at all. With compression on, a quarter of the budget holds
    float chunks (service.FLOAT_SHARE), where every layer writes a prefill piece's new chunks before
    they are coded: one prefill chunk's worth and two more must fit there. One budget for all
    variants, so their times compare; the record gives it in MB."""
    chunk = chunk_bytes(engine)
    share = int(cfg.kv_share * cfg.contexts * -(-cfg.context_tokens // DEFAULT_CHUNK) * chunk)
    floats = (-(-engine.config.prefill_chunk // DEFAULT_CHUNK) + 2) * chunk
    return max(share, floats * FLOAT_SHARE)


def run_trace(engine, variant: Variant, pattern: str, starts, pieces, cfg: TraceConfig, directory: str) -> TraceResult:
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    budget = trace_budget(engine, cfg)
    svc = Service(
        engine, directory=directory, kv_budget=budget, kv_compression=variant.compression, lifecycle=variant.lifecycle
    )
    tok = engine.tokenizer
    try:
        ids = []
        for s in starts:  # the contexts exist (and crowd the budget) before the trace starts
            ctx = svc.new_context()
            list(svc.call(ctx, tok.decode(s), max_tokens=1))
            ids.append(ctx)
        rng = np.random.default_rng(cfg.seed)
        order = call_sequence(pattern, cfg.contexts, cfg.calls, rng)
        gaps = rng.exponential(cfg.mean_gap_s, cfg.calls)
        used = [0] * cfg.contexts
        res = TraceResult(variant.name, pattern, kv_budget=budget)
        s0 = svc.stats()
        read0, rec0, wr0 = s0.chunks_read, s0.chunks_recomputed, s0.chunks_written
        for c, gap in zip(order, gaps):
            idle_until = time.perf_counter() + gap
            while time.perf_counter() < idle_until and svc.swap_out_idle(4):
                pass
            piece = pieces[c][used[c] % len(pieces[c])]
            used[c] += 1
            t0 = time.perf_counter()
            steps = svc.call(ids[c], tok.decode(piece), max_tokens=cfg.generate, temperature=0.0)
            next(steps)
            res.ttft_s.append(time.perf_counter() - t0)
            for _ in steps:
                pass
            res.switch_s.append(svc.last.switch_s)
        s1 = svc.stats()
        res.chunks_read, res.chunks_recomputed = s1.chunks_read - read0, s1.chunks_recomputed - rec0
        res.chunks_written = s1.chunks_written - wr0
        return res
    finally:
        svc.close()
        shutil.rmtree(directory, ignore_errors=True)


def full_context_restore(engine, corpus: str, directory: str, tokens: int | None = None) -> dict:
    """One context at (nearly) the model's whole context, swapped to flash: seconds until it is ready
    again by the pipeline, by reading only, and by recomputing it all (re-prefill)."""
    shutil.rmtree(directory, ignore_errors=True)
    tokens = tokens or engine.model_context - 8
    svc = Service(engine, directory=directory, kv_budget=(-(-tokens // 16) + 2) * chunk_bytes(engine))
    try:
        ids = engine.tokenizer.encode(corpus)[:tokens]
        ctx = svc.new_context()
        list(svc.call(ctx, engine.tokenizer.decode(ids), max_tokens=4))  # a few steps: the costs the split uses
        out = {"tokens": svc.get(ctx).kv_tokens}
        for how in (Restore.PIPELINE, Restore.READ, Restore.RECOMPUTE):
            svc.swap_out(ctx)
            _drop_page_cache()
            t = time.perf_counter()
            rep = svc.bring_back(ctx, how)
            out[how.value] = {
                "seconds": time.perf_counter() - t,
                "read": rep.chunks_read,
                "recomputed": rep.chunks_recomputed,
            }
        return out
    finally:
        svc.close()
        shutil.rmtree(directory, ignore_errors=True)


def chunk_shape(engine) -> ChunkShape:
    """A 16-token chunk of the engine's model."""
    a = engine.args
    return ChunkShape(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 16)


def chunk_bytes(engine) -> int:
    """One 16-token chunk of the engine's model (float32, as the CPU backends hold it)."""
    return chunk_shape(engine).nbytes


def _drop_page_cache() -> None:
    """Cold reads where we may (root on Linux); the reader bypasses the page cache anyway."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:  # (a kernel control, not data)
            f.write("3\n")
    except OSError:
        pass
