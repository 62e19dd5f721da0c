"""Decoding fed by a fixed text (teacher forcing), the way MoE benchmarks run: after a prompt, each
step is given the text's next token, not the model's own pick, so routing follows real text in every
engine compared (random weights decode one token over and over, which routes the same experts every
step and lets any expert cache look good). Used by `python -m mlx_flash.bench moe`.

`ours` times our engine's steps (one `forward` of one token each) and reads its counters (the
routing of the same steps is recorded in a pass of its own, calibrate.routes.record_teacher_forced:
recording takes the routing to the host, which the timed pass need not do); `llama_cpp` times
llama.cpp evaluating the same token ids one at a time on the same GGUF."""

from __future__ import annotations

import statistics
import time

import numpy as np


def ours(engine, ids: list[int], prompt: int) -> dict:
    """Median ms per step and tokens/s, MB read per step, and the expert cache's hit rate over the
    decode steps (None when every expert is resident), for `ids[prompt:]` fed one at a time."""
    caches = engine.new_caches()
    engine.prefill(ids[:prompt], caches)
    ms, read = [], []
    hits0 = _hits(engine)
    for t in ids[prompt:]:
        b0 = engine.io_counters()[2]
        t0 = time.perf_counter()
        engine.forward([t], caches)
        ms.append((time.perf_counter() - t0) * 1e3)
        read.append((engine.io_counters()[2] - b0) / 1e6)
    engine.release(caches)
    hits1 = _hits(engine)
    hit = None
    if hits1 is not None:
        h, m = hits1[0] - hits0[0], hits1[1] - hits0[1]
        hit = h / max(1, h + m)
    med = statistics.median(ms)
    return {"ms": med, "tok_s": 1e3 / med, "mb_read": statistics.median(read), "hit_rate": hit}


def _hits(engine) -> tuple[int, int] | None:
    stats = engine.ffn.stats()
    if not stats.expert_hits:
        return None
    h, m = map(sum, zip(*stats.expert_hits))
    return h, m


def llama_cpp(path: str, ids: list[int], prompt: int, threads: int, use_mmap: bool = True) -> dict:
    """llama.cpp on the same GGUF and token ids: the prompt evaluated at once, then one token per step."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=max(256, len(ids) + 8), n_threads=threads, use_mmap=use_mmap, verbose=False)
    llm.eval(ids[:prompt])
    ms = []
    for t in ids[prompt:]:
        t0 = time.perf_counter()
        llm.eval([t])
        ms.append((time.perf_counter() - t0) * 1e3)
    np.asarray(llm.scores[llm.n_tokens - 1])  # the last step's logits are there
    del llm
    med = statistics.median(ms)
    return {"ms": med, "tok_s": 1e3 / med}
