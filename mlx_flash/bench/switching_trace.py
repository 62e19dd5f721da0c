"""The switching benchmark where switching costs: a handful of long contexts (thousands of tokens
of real text each) on a large model, more of them than the KV budget holds, visited in a stated
trace; `python -m mlx_flash.bench switching` runs it.

The trace: `switches` visits, each to a context drawn from a Zipf distribution over the contexts
(rank r with weight 1 / r^s, the ranks a random permutation; never the context just visited), each
visit `turns` calls of `call_tokens` new tokens of its article and `generate` greedy tokens. A
visit's first call is the switch: its latency is the time until the context is ready to prefill the
new tokens (making room, reading, recomputing: CallReport.switch_s). Between calls the service gets
an exponential think time as idle time (spent on ahead-of-time swap-out where the variant has it,
never slept).

The contexts are prefilled once (`build`, under the compression of the variant measured: every
variant then starts from a copy of the same directory, the same chunks at the same widths on
flash, nothing in memory) because prefilling thousands of tokens of a 7B model takes minutes.
Recompute (drop the KV, prefill again) is measured on the trace's first few switches only, for the
same reason.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..durable import write_json
from ..errors import ConfigError
from ..store.atomic_dir import OutputError
from ..service.coded_chunks import packed_bytes
from ..service.compression import Compression, Scheme
from ..service.service import DEFAULT_CHUNK, FLOAT_SHARE, Service
from .service_trace import Variant, chunk_shape

IDS_FILE = "trace-contexts.json"


@dataclass(frozen=True)
class SwitchTrace:
    contexts: int = 6
    min_tokens: int = 2048  # each context starts as min..max tokens of one article
    max_tokens: int = 4096
    switches: int = 12
    turns: int = 2  # calls per visit
    call_tokens: int = 32
    generate: int = 4
    zipf_s: float = 1.0
    kv_contexts: float = 2.0  # the KV budget, in contexts of the mean starting length
    think_s: float = 1.0  # mean idle time between calls
    seed: int = 0

    def __post_init__(self):
        if not 2 <= self.contexts or not 1 <= self.min_tokens <= self.max_tokens:
            raise ConfigError("a switching trace needs 2 or more contexts and 1 <= min tokens <= max tokens")
        if self.switches < 1 or self.turns < 1 or self.call_tokens < 1 or self.generate < 1:
            raise ConfigError("switches, turns, call tokens and generated tokens must be positive")
        if self.kv_contexts <= 0 or self.zipf_s < 0 or self.think_s < 0:
            raise ConfigError("the KV budget must be positive, the Zipf exponent and think time not negative")


def visits(trace: SwitchTrace) -> list[int]:
    """The context of each visit: Zipf over a random ranking, never the one just visited."""
    rng = np.random.default_rng(trace.seed)
    rank = rng.permutation(trace.contexts)  # rank[i]: the context at popularity rank i + 1
    weight = 1.0 / np.arange(1, trace.contexts + 1) ** trace.zipf_s
    out: list[int] = []
    while len(out) < trace.switches:
        c = int(rank[rng.choice(trace.contexts, p=weight / weight.sum())])
        if not out or c != out[-1]:
            out.append(c)
    return out


@dataclass
class Built:
    """The prefilled contexts: their directory, service ids, starting lengths and each one's call
    pieces (tokens, in order)."""

    directory: str
    ids: list[str]
    tokens: list[int]
    pieces: list[list[list[int]]]
    kv_budget: int
    build_s: float


def _texts(engine, corpus: str, trace: SwitchTrace) -> tuple[list[list[int]], list[list[list[int]]]]:
    ids = engine.tokenizer.encode(corpus)
    rng = np.random.default_rng(trace.seed + 1)
    lengths = rng.integers(trace.min_tokens, trace.max_tokens + 1, trace.contexts)
    calls = trace.switches * trace.turns  # at most every call in one context
    need = int(lengths.sum()) + trace.contexts * calls * trace.call_tokens
    if len(ids) < need:
        raise ConfigError(f"the corpus has {len(ids)} tokens; this trace needs {need}")
    starts, pieces, at = [], [], 0
    for n in lengths:
        starts.append(ids[at : at + n])
        tail = ids[at + n : at + n + calls * trace.call_tokens]
        pieces.append([tail[k : k + trace.call_tokens] for k in range(0, len(tail), trace.call_tokens)])
        at += n + calls * trace.call_tokens
    return starts, pieces


def kv_budget(engine, trace: SwitchTrace, tokens: list[int], compression=None) -> int:
    """`kv_contexts` contexts of the mean starting length, in whole chunks at the width they are held
    in memory, and never less than the longest context grows to in the trace (a call's context must
    fit whole). Without compression chunks are float32 slots. With it, complete chunks sit in the
    arena at their width (tolerance:R at its mean, 8R bits) and a quarter of the budget is float
    slots (service.FLOAT_SHARE), which must hold one prefill chunk's new chunks as every layer writes
    them; so that a compressed budget holds as few contexts as the trace asks, not four times more."""
    shape = chunk_shape(engine)
    grown = max(tokens) + trace.switches * trace.turns * (trace.call_tokens + trace.generate)
    chunks = int(np.ceil(max(trace.kv_contexts * float(np.mean(tokens)), grown) / DEFAULT_CHUNK)) + 1
    c = Compression.parse(compression)
    if not c.on:
        return chunks * shape.nbytes
    bits = c.bits if c.scheme is Scheme.STATIC else 8 * c.ratio
    at4, at8 = packed_bytes(shape.array_shape, 4), packed_bytes(shape.array_shape, 8)
    held = at4 + (bits - 4) * (at8 - at4) / 4  # linear in the width: a fractional mean in between
    arena = chunks * int(held)
    floats = (-(-engine.config.prefill_chunk // DEFAULT_CHUNK) + 2) * shape.nbytes
    return max(-(-arena * FLOAT_SHARE // (FLOAT_SHARE - 1)), floats * FLOAT_SHARE)


def build(engine, corpus: str, trace: SwitchTrace, directory: str, compression: str, progress=print) -> Built:
    """Prefill every context once, under `compression`, and leave all of it on flash."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    starts, pieces = _texts(engine, corpus, trace)
    budget = kv_budget(engine, trace, [len(s) for s in starts], compression)
    t0 = time.perf_counter()
    ids = []
    with Service(engine, directory=directory, kv_budget=budget, kv_compression=compression) as svc:
        for k, s in enumerate(starts):
            ctx = svc.new_context()
            list(svc.call(ctx, engine.tokenizer.decode(s), max_tokens=1))
            ids.append(ctx)
            progress(f"context {k + 1}/{len(starts)}: {len(s)} tokens, {time.perf_counter() - t0:.0f} s")
        svc.flush()
        tokens = [svc.get(c).kv_tokens for c in ids]
    built = Built(directory, ids, tokens, pieces, budget, time.perf_counter() - t0)
    ids = {k: v for k, v in asdict(built).items() if k != "directory"}
    write_json(os.path.join(directory, IDS_FILE), ids, OutputError, indent=None)  # (--reuse reads it)
    return built


def load_built(directory: str) -> Built:
    """A build left by an earlier run (`python -m mlx_flash.bench switching --reuse`)."""
    try:
        with open(os.path.join(directory, IDS_FILE)) as f:
            return Built(directory=directory, **json.load(f))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{directory} holds no switching-trace build ({e})") from None


@dataclass
class ReplayResult:
    variant: str
    switch_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)  # every call
    chunks_read: int = 0
    chunks_recomputed: int = 0
    chunks_written: int = 0
    seconds: float = 0.0

    def summary(self) -> dict:
        return {
            "variant": self.variant,
            "switches": len(self.switch_s),
            "switch_mean_s": float(np.mean(self.switch_s)),
            "switch_p50_s": float(np.median(self.switch_s)),
            "ttft_mean_s": float(np.mean(self.ttft_s)),
            "chunks_read": self.chunks_read,
            "chunks_recomputed": self.chunks_recomputed,
            "chunks_written": self.chunks_written,
            "seconds": self.seconds,
        }


def replay(
    engine, variant: Variant, trace: SwitchTrace, built: Built, directory: str, switches: int | None = None
) -> ReplayResult:
    """The trace's first `switches` visits (all by default) on a copy of the build, under `variant`."""
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(built.directory, directory)  # (not durable: this replay's scratch, removed after it)
    order = visits(trace)[:switches]
    rng = np.random.default_rng(trace.seed + 2)
    res = ReplayResult(variant.name)
    used = [0] * len(built.ids)
    t_start = time.perf_counter()
    # Recompute holds its contexts as float slots (its restore prefills them whole): the same number
    # of contexts' budget in float32; a compressed variant's is the build's.
    on = Compression.parse(variant.compression).on
    svc = Service(
        engine,
        directory=directory,
        kv_budget=built.kv_budget if on else kv_budget(engine, trace, built.tokens),
        kv_compression=variant.compression,
        lifecycle=variant.lifecycle,
    )
    try:
        if svc.problems:
            raise ConfigError(f"the build's copy did not load: {svc.problems[0]}")
        s = svc.stats()  # (one object, updated in place: its numbers are taken now)
        before = (s.chunks_read, s.chunks_recomputed, s.chunks_written)
        for c in order:
            for turn in range(trace.turns):
                idle_until = time.perf_counter() + rng.exponential(trace.think_s)
                while time.perf_counter() < idle_until and svc.swap_out_idle(4):
                    pass
                piece = built.pieces[c][used[c]]
                used[c] += 1
                t0 = time.perf_counter()
                steps = svc.call(built.ids[c], engine.tokenizer.decode(piece), max_tokens=trace.generate)
                next(steps)
                res.ttft_s.append(time.perf_counter() - t0)
                for _ in steps:
                    pass
                if turn == 0:
                    res.switch_s.append(svc.last.switch_s)
        s = svc.stats()
        res.chunks_read, res.chunks_recomputed, res.chunks_written = (
            n - b for n, b in zip((s.chunks_read, s.chunks_recomputed, s.chunks_written), before)
        )
        res.seconds = time.perf_counter() - t_start
        return res
    finally:
        svc.close()
        shutil.rmtree(directory, ignore_errors=True)
