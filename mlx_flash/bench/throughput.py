"""One measured configuration of the throughput benchmark (`python -m mlx_flash.bench throughput` runs each in a
process of its own, inside a memory cgroup when asked, and reads the JSON it prints).

Modes (FlexGen §6's comparisons on this platform):
  single    one sequence at a time with today's exact streaming (each FFN layer the budget cannot
            hold read whole every token, as ffn="stream"), `single_sequences` of the prompts
  row       batched, each micro-batch walking every layer: streamed layers re-read per micro-batch
  flexgen   the zig-zag block schedule with the policy the LP search chooses
  naive     the zig-zag schedule with a fixed policy, no search (the ablation)
  no-overlap the searched policy with reads not overlapped with compute (the ablation)
Tokens/s counts generated tokens over the whole run, prefill included (FlexGen's measure); the
decode-only rate and the prefill time are reported beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from ..api import load
from ..batching.prompts import encode_all
from ..batching.schedule import Order
from ..batching.sequence import SamplingOptions
from ..memory import peak_rss
from ..offload.cost_model import Workload
from ..offload.policy import Policy
from ..offload.run import choose, run_batch

MODES = ("single", "row", "flexgen", "naive", "no-overlap")
NAIVE_BATCH = 8  # the fixed policy of the no-search ablation: blocks of 8 sequences, nothing held


@dataclass(frozen=True)
class BenchConfig:
    mode: str
    store: str | None  # None: the default model
    backend: str = "torch"
    memory_budget: str = "auto"
    weights_budget: str | None = None
    sequences: int = 32
    prompt: int = 128
    generate: int = 32
    single_sequences: int = 4  # sequences the single mode runs (its rate does not depend on how many)
    kv_bits: int = 0
    policy: str | None = None  # JSON for the naive mode (default: blocks of NAIVE_BATCH, one micro-batch each)
    ffn: str = "auto"
    arithmetic: str = "auto"


def prompt_texts(tokenizer, text: str, n: int, length: int, seed: int = 0) -> list[str]:
    """n prompts of about `length` tokens each: windows of real text at random places."""
    ids = tokenizer.encode(text[: max(200_000, 40 * length * n)], add_special_tokens=False)
    rng = np.random.default_rng(seed)
    out = []
    for start in rng.integers(0, len(ids) - length - 1, n):
        window = ids[int(start) : int(start) + length]
        s = tokenizer.decode(window)
        while len(tokenizer.encode(s)) > length and len(window) > 1:  # re-encoding may merge differently
            window = window[:-1]
            s = tokenizer.decode(window)
        out.append(s)
    return out


def run_config(cfg: BenchConfig, text: str) -> dict:

    t_load = time.perf_counter()
    engine = load(
        cfg.store,
        backend=cfg.backend,
        memory_budget=cfg.memory_budget,
        weights_budget=cfg.weights_budget,
        ffn=cfg.ffn,
        arithmetic=cfg.arithmetic,
        batch=True,
        progress=False,
    )
    load_s = time.perf_counter() - t_load
    prompts = prompt_texts(engine.tokenizer, text, cfg.sequences, cfg.prompt)
    row = {
        "mode": cfg.mode,
        "store": cfg.store or "default",
        "backend": cfg.backend,
        "ffn": engine.config.ffn.value,
        "load_s": load_s,
        "memory_limit": engine.memory_plan.get("limit"),
    }
    with engine:
        if cfg.mode == "single":
            row.update(_single(engine, prompts[: cfg.single_sequences], cfg.generate))
        else:
            row.update(_batched(engine, prompts, cfg))
    row["peak_rss"] = peak_rss()
    return row


def _single(engine, prompts, generate: int) -> dict:
    io0 = engine.io_bytes()
    tokens = prefill = decode = 0.0
    ids = []
    for p in prompts:
        ids.append([step.token for step in engine.stream_generate(p, max_tokens=generate)])
        s = engine.last
        tokens += s.generated_tokens
        prefill += s.prefill_s
        decode += s.decode_s
    return {
        "sequences": len(prompts),
        "generated_tokens": int(tokens),
        "prefill_s": prefill,
        "decode_s": decode,
        "seconds": prefill + decode,
        "tokens_per_s": tokens / (prefill + decode),
        "decode_tokens_per_s": tokens / decode if decode else 0.0,
        "bytes_read": engine.io_bytes() - io0,
        "tokens": ids,  # each sequence's generated ids (the batched modes' must equal them)
    }


def _batched(engine, prompts, cfg: BenchConfig) -> dict:
    kv = (0, 4) if cfg.kv_bits else (0,)
    policy = None
    if cfg.mode in ("row", "no-overlap"):  # the searched policy's batch shape, one thing changed
        work = encode_all(engine, prompts, cfg.generate)
        w = Workload(len(work), max(len(i) for i, _ in work), cfg.generate)
        best = choose(engine, w, None, kv)[1].policy
        policy = replace(best, order=Order.ROW) if cfg.mode == "row" else replace(best, overlap=False)
    elif cfg.mode == "naive":
        policy = Policy.from_json(cfg.policy) if cfg.policy else Policy(gpu_batch=min(cfg.sequences, NAIVE_BATCH))
    seqs, run = run_batch(engine, prompts, cfg.generate, SamplingOptions(), policy, False, kv_bits=kv)
    return {
        "sequences": run.sequences,
        "generated_tokens": run.generated_tokens,
        "prefill_s": run.prefill_s,
        "decode_s": run.decode_s,
        "seconds": run.seconds,
        "tokens_per_s": run.tokens_per_s,
        "decode_tokens_per_s": run.generated_tokens / run.decode_s if run.decode_s else 0.0,
        "bytes_read": run.bytes_read,
        "tokens": [s.tokens for s in sorted(seqs, key=lambda s: s.index)],  # each sequence's sampled ids
        "policy": run.policy,
        "prefill_pass": run.prefill_pass,
        "predicted_s": run.predicted_s,
        "predicted_tokens_per_s": run.predicted_tokens_per_s,
        "memory_planned": run.memory_planned,
        "room": run.room,
        "compute": run.compute,
    }


def against_single(rows: list[dict]) -> list[str]:
    """The cap one-at-a-time's prefill puts on a batched mode's ratio over it ((prefill + decode) /
    prefill of one sequence), each batched row's ratio as a share of that cap, and whether its first
    sequences generated exactly the tokens they did one at a time (the same prompts, greedy). Adds
    "cap", "of_cap" and "same_as_single" to the rows; returns the lines to print."""
    single = next((r for r in rows if r.get("mode") == "single" and "tokens_per_s" in r), None)
    if single is None or not single["sequences"]:
        return []
    p, d = single["prefill_s"] / single["sequences"], single["decode_s"] / single["sequences"]
    cap = (p + d) / p
    lines = [f"the cap one at a time's prefill puts on the ratio: {cap:.2f}x ({p:.2f} s prefill + {d:.2f} s decode)"]
    for r in rows:
        if r is single or "tokens_per_s" not in r or "tokens" not in r:
            continue
        ratio = r["tokens_per_s"] / single["tokens_per_s"]
        n = len(single["tokens"])
        same = [t[: len(s)] for t, s in zip(r["tokens"][:n], single["tokens"])] == single["tokens"]
        r.update(cap=cap, of_cap=ratio / cap, same_as_single=same)
        lines.append(
            f"{r['label']}: {ratio:.2f}x = {ratio / cap:.2f} of the cap; its first {n} sequences "
            + ("generated the same tokens as one at a time" if same else "DIFFER from one at a time")
        )
    return lines
