"""Streamed activation sparsity, bounded by the drive: the reads a thresholded model streamed from flash
would make (its own masks, on Wikipedia text, each streamed product's active channels read once its
input is known) replayed by the reader pool against dense's reads of the same products, page cache
dropped. A decode step that streams them can go no faster than these reads alone. One JSON record
(mlx_flash/bench/sparse_reads.py says what is counted):

    python -m mlx_flash.bench sparse-reads [--models 7b,default] [--levels 7b=0.5,default=0.25] [--tokens 8]
        [--budgets 7b=memory:1900MB,default=weights:50%] [--gaps 0,16384,65536]
        [--layouts stored,requantized] [--group-calibration 2048] [--quality default]
        [--quality-levels 0.25,0.5] [--reader-threads 8] [--threads 2] [--json bench_results/sparse-reads.json]

--budgets: per model, the memory budget (memory:) or weights budget (weights:) at which the dense
engine runs, ffn auto. It is loaded there and timed decoding, and its plan says which products are
streamed: every FFN layer, and the attention of the layers it reads when they compute. The defaults
are the 7B shape in a 2 GB cgroup (its limit less 100 MB, as the memory benchmark plans it) and the
default model at a weights budget of 50%.

Besides the model's own masks (TEAL: single channels at its thresholds), each model's reads are
replayed with its inputs zeroed by whole groups of 32 channels at the same level (bench/group_masks.py:
the level's share of each input's groups, by their RMS in the dense model): reads of whole group blocks.
The quality part states what that costs: perplexity of --quality with channels and with groups
zeroed, every input at the same level, thresholds from --group-calibration Austen tokens.

Needs root (the page cache is dropped before each replay) and the machine to itself: the figures are
a drive's rate.
"""

import argparse
import os
import statistics
import sys

from mlx_flash.api import load
from mlx_flash.bench import decode_pairs as dp
from mlx_flash.bench import group_masks as gm
from mlx_flash.bench import sparse_reads as sr
from mlx_flash.bench.commands import recorded
from mlx_flash.bench.models import bench_model
from mlx_flash.bench.quality import wikipedia
from mlx_flash.bench.record import bench_provenance, write
from mlx_flash.bench.sparsity_parts import say
from mlx_flash.calibrate.corpora import read_corpus
from mlx_flash.calibrate.perplexity_eval import perplexity
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.store.manifest import FFN_FILE, RESIDENT_FILE

GROUP = 32  # the group masks' width: the GGUF group, so a zeroed group's scales are skipped too
# the level a streamed 7B shape would be run at (the largest its resident figures give), and the
# default model's recommended one (the largest within +2% perplexity: docs/results/sparsity.md)
LEVELS = {"7b": 0.5, "default": 0.25}
BUDGETS = {"7b": "memory:1900MB", "default": "weights:50%"}
DECODE_PROMPT, DECODE_RUNS = 16, 3
DECODE_TOKENS = {"7b": 8}  # the 7B shape decodes about half a token a second streamed; others 32


def dense_engine(gguf: str, budget: str, tokens: int, threads: int) -> dict:
    """The dense engine at `budget` ("memory:X" or "weights:X", ffn auto: what it streams, it reads
    each token): how many layers' attention it streams, and the median tokens/s of DECODE_RUNS runs of
    `tokens` greedy tokens after a DECODE_PROMPT-token prompt."""
    kind, _, size = budget.partition(":")
    if kind not in ("memory", "weights") or not size:
        raise FlashError(f"budget {budget!r} is not memory:SIZE or weights:SIZE")
    with load(gguf, threads=threads, progress=False, **{f"{kind}_budget": size}) as e:
        ids = e.tokenizer.encode(dp.prompt_text())[:DECODE_PROMPT]
        dp.engine_run(e, ids, 2)  # warm
        tps = statistics.median(dp.engine_run(e, ids, tokens)[1] for _ in range(DECODE_RUNS))
        streamed = int(e.memory_plan["streamed_layers"])
        layers = e.args.num_hidden_layers
    say(f"  dense engine at {budget}: {tps:.3f} tok/s, {streamed} of {layers} layers' attention streamed")
    return {"budget": budget, "tok_s": tps, "tokens": tokens, "streamed_attention": streamed, "layers": layers}


def model_part(name: str, a, level: float, budget: str, gaps: list[int], layouts: list[str]) -> dict:
    gguf = bench_model(name)
    engine = dense_engine(gguf, budget, DECODE_TOKENS.get(name, 32), a.threads)
    attention_from = engine["layers"] - engine["streamed_attention"]
    with load(gguf, ffn="resident", sparsity=level, sparsity_rows="all", threads=a.threads, progress=False) as e:
        ids = e.tokenizer.encode(wikipedia(a.tokens * 16))[: a.tokens]
        products, _ = sr.products_of(e)
        masks = sr.capture_masks(e, ids)
        store = e.store.path
    with load(gguf, ffn="resident", threads=a.threads, progress=False) as d:  # dense: the group masks' model
        # the dense model's group RMS on the replayed tokens, `level` of each input's groups zeroed: the
        # reads at the share the channels' masks have (zeroing as it goes, a model this approximation
        # breaks zeroes far more in its later layers); the quality part zeroes as it goes
        groups = gm.open_loop_masks(gm.group_rms(d, ids, GROUP, context=len(ids)), GROUP, level)
    streamed = [p for p in products if p.role in ("gate_up", "down") or p.layer >= attention_from]
    place = sr.Placement.lay_out(
        [
            (os.path.join(store, FFN_FILE), [p for p in streamed if p.role in ("gate_up", "down")]),
            (os.path.join(store, RESIDENT_FILE), [p for p in streamed if p.role in ("qkv", "o")]),
        ]
    )
    rows = range(len(ids))
    out = {
        "dense_engine": engine,
        "level": level,
        "tokens": len(ids),
        "attention_from": attention_from,
        "streamed_products": len(streamed),
        "dense_mb": sum(p.nbytes for p in streamed) / 1e6,
        "zeroed": sr.zeroed_share(streamed, masks),
        "carried_over": sr.carried_over(streamed, masks),
        "group": GROUP,
        "group_zeroed": sr.zeroed_share(streamed, groups),
        "reads": {},
    }
    kept = out["carried_over"]
    say(
        f"  {len(streamed)} products streamed, {out['dense_mb']:.1f} MB dense, {out['zeroed']:.1%} inputs zeroed; "
        f"{kept['hit_share']:.1%} of a token's active bytes were active the token before ({kept['held_mb']:.0f} MB)"
    )
    cases = [
        ("dense, one batch a token", lambda: sr.dense_token_batches(streamed, len(ids), place)),
        ("dense, a batch a product", lambda: sr.token_batches(streamed, {}, rows, place, None, 0)),
    ]
    cases += [
        (
            f"{layout}, gap {gap}",
            lambda layout=layout, gap=gap: sr.token_batches(streamed, masks, rows, place, layout, gap),
        )
        for layout in layouts
        for gap in gaps
    ]
    cases += [
        (
            f"groups of {GROUP} ({out['group_zeroed']:.1%} zeroed), stored, gap 0",
            lambda: sr.token_batches(streamed, groups, rows, place, "stored", 0),
        )
    ]
    for label, batches in cases:
        got = sr.replay(batches(), a.reader_threads, len(ids))
        out["reads"][label] = got
        say(
            f"  {label}: {got['s_per_token']:.3f} s a token, {got['bytes_per_token'] / 1e6:.1f} MB read "
            f"({got['reads_per_token']:.0f} reads)"
        )
    return out


def quality_part(name: str, a, levels: list[float]) -> dict:
    """Perplexity over 4,096 Wikipedia tokens of the dense model, and with every row's inputs zeroed
    by single channels (every input at the same level) and by groups of GROUP, thresholds from Austen."""
    with load(bench_model(name), ffn="resident", threads=a.threads, progress=False) as d:
        austen = d.tokenizer.encode(read_corpus("austen"))[: a.group_calibration]
        text = wikipedia(4096 * 12)
        out = {
            "dense": perplexity(d, text, context=512, max_tokens=4096)["perplexity"],
            "channels": {},
            "groups": {},
            "group": GROUP,
            "model": name,
        }
        say(f"  dense: perplexity {out['dense']:.4f}")
        for level in levels:
            for kind, width in (("channels", 1), ("groups", GROUP)):
                ppl = gm.group_perplexity(d, text, width, gm.group_thresholds(d, austen, width, level))
                out[kind][f"{level:g}"] = ppl
                say(f"  {level:.0%} by {kind}: perplexity {ppl:.4f} ({ppl / out['dense'] - 1:+.2%})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench sparse-reads", description=first_paragraph(__doc__))
    p.add_argument("--models", default="7b,default", help="comma list: 7b, default or GGUF paths")
    p.add_argument("--levels", default=",".join(f"{k}={v}" for k, v in LEVELS.items()), help="per model, its sparsity")
    p.add_argument("--tokens", type=int, default=8, help="Wikipedia tokens whose reads are replayed (default 8)")
    p.add_argument("--gaps", default="0,16384,65536", help="bytes between two reads below which they merge")
    p.add_argument("--layouts", default=",".join(sr.LAYOUTS), help=f"comma list of: {', '.join(sr.LAYOUTS)}")
    p.add_argument("--budgets", default=",".join(f"{k}={v}" for k, v in BUDGETS.items()), help="per model")
    p.add_argument("--group-calibration", type=int, default=2048, help="Austen tokens the group thresholds come from")
    p.add_argument("--quality", default="default", help="the model whose perplexity by channels and groups is scored")
    p.add_argument("--quality-levels", default="0.25,0.5", help="levels the quality part scores ('' to skip it)")
    p.add_argument("--reader-threads", type=int, default=8, help="the reader pool's threads (default 8)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="compute threads while masks are taken")
    p.add_argument("--json", default="bench_results/sparse-reads.json")
    a = p.parse_args(argv)
    try:
        gaps = [int(g) for g in a.gaps.split(",")]
        budgets = dict(kv.split("=", 1) for kv in a.budgets.split(","))
        levels = {k: float(v) for k, v in (kv.split("=") for kv in a.levels.split(","))}
        scored = [float(v) for v in a.quality_levels.split(",")] if a.quality_levels else []
    except ValueError:
        print("error: --gaps, --levels, --quality-levels or --budgets is malformed (see --help)", file=sys.stderr)
        return 2
    layouts = a.layouts.split(",")
    unknown = [x for x in layouts if x not in sr.LAYOUTS]
    if unknown or a.tokens < 1 or not all(0 < v < 1 for v in [*levels.values(), *scored]):
        print(f"error: --layouts from {', '.join(sr.LAYOUTS)}, --tokens >= 1 and levels in (0, 1)", file=sys.stderr)
        return 2
    header, record = bench_provenance("sparse-reads", argv), {"models": {}}

    def fill() -> None:
        for name in a.models.split(","):
            say(f"[{name}]")
            budget = budgets.get(name, "weights:50%")
            record["models"][name] = model_part(name, a, levels.get(name, 0.5), budget, gaps, layouts)
            write(a.json, header, **record)
        if scored:
            say(f"[quality: {a.quality}]")
            record["quality"] = quality_part(a.quality, a, scored)

    return recorded(a.json, header, record, fill)
