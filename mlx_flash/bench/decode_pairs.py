"""Prefill and decode speed of an engine against llama.cpp (llama-cpp-python) on the same prompt: one
run of each (a prompt's prefill, then exactly `gen` greedy tokens, EOS ignored), and interleaved pairs
of runs, ours and the peer's in alternating order, so that a machine whose speed drifts (shared,
throttled) moves both sides of a pair alike; the pair ratios' median and lowest are the figures."""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..calibrate import corpus_path
from ..errors import FlashError


def prompt_text(chars: int = 20000) -> str:
    """Real Wikipedia text (a repeated sentence when the corpus is not fetched)."""
    try:
        with open(corpus_path("wikipedia"), encoding="utf-8") as fh:
            return fh.read()[:chars]
    except FlashError:
        return "The quick brown fox jumps over the lazy dog. " * (chars // 45)


def engine_run(engine, ids, gen: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one run from an empty cache."""
    caches = engine.new_caches()
    t0 = time.perf_counter()
    logits = engine.prefill(ids, caches)
    t1 = time.perf_counter()
    for _ in range(gen):
        logits = engine.forward([int(np.argmax(logits))], caches)[-1]
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), gen / (t2 - t1) if gen else 0.0


def peer_built() -> bool:
    """Whether llama.cpp's Python binding (the peer, `make peers`) can be imported here."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def open_llama(gguf: str, n_ctx: int, threads: int):
    """llama.cpp on the GGUF (batches of 512 tokens, a context of at least 1,024), or None when
    llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(gguf, n_ctx=max(n_ctx, 1024), n_threads=threads, n_batch=512, verbose=False)


def llama_run(llm, ids, gen: int) -> tuple[float, float]:
    """engine_run's measurement for llama.cpp: its last token's logits read in place (no copy)."""

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    for _ in range(gen):
        llm.eval([int(np.argmax(last_logits()))])
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), gen / (t2 - t1) if gen else 0.0


def medians(run, runs: int) -> dict:
    """Medians of `runs` runs after a warm-up run (first touch of the weights, allocators, paths)."""
    run()
    pre, dec = zip(*(run() for _ in range(runs)))
    return {
        "prefill_tps": statistics.median(pre),
        "decode_tps": statistics.median(dec),
        "prefill_all": list(pre),
        "decode_all": list(dec),
    }


def interleaved(ours, peer, pairs: int, key: int = 1) -> dict:
    """`pairs` pairs of (ours(), peer()) after a warm-up of each, ours first in even pairs and second
    in odd ones; key 1 compares decode tokens/s, 0 prefill. Every pair's rates and ratio, and the
    median and lowest ratio. With no peer (llama.cpp not built: peer is None), ours alone, `pairs`
    times, and the peer's figures None."""
    ours()
    if peer is not None:
        peer()
    rows = []
    for i in range(pairs):
        if peer is None:
            a, b = ours(), None
        elif i % 2 == 0:
            a, b = ours(), peer()
        else:
            b, a = peer(), ours()
        rows.append({"ours": a[key], "peer": b and b[key], "ratio": b and a[key] / b[key]})
    out = {"pairs": rows, "ours_median": statistics.median(r["ours"] for r in rows)}
    if peer is None:
        return out | {"median_ratio": None, "lowest_ratio": None, "peer_median": None}
    ratios = [r["ratio"] for r in rows]
    return out | {
        "median_ratio": statistics.median(ratios),
        "lowest_ratio": min(ratios),
        "peer_median": statistics.median(r["peer"] for r in rows),
    }


def read_stream_gbs(gigabytes: float = 4.0, threads: int = 2, repeat: int = 3) -> float:
    """GB/s of a read-only pass over `gigabytes` of float32 (torch's sum on `threads` threads: vector
    loads, nothing written), best of `repeat`: what a decode step that reads its weights once from
    memory can approach."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gigabytes * 1e9) // 4)
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def token_read_bytes(gguf: str) -> int:
    """The bytes one decode token reads of a GGUF's weights: every tensor but the embedding table, of
    which a token reads one row (counted whole where there is no separate output matrix: the head
    then reads all of it)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    tied = "output.weight" not in sizes
    return sum(n for name, n in sizes.items() if tied or name != "token_embd.weight")
