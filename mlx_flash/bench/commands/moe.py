"""MoE decode fed by real text (teacher forcing), ours beside llama.cpp on the same GGUF.

    python -m mlx_flash.bench moe --model moe-8l|FILE.gguf [--backends mlx,torch] [--weights-budget 4GB]
                                  [--tokens 32] [--prompt-tokens 64] [--no-llama-cpp] [--per-expert]
                                  [--json OUT]

After a prompt of the Wikipedia corpus, each step is fed the text's next token (not the engine's own
pick), in every engine: synthetic weights decode one token over and over, which routes the same
experts every step. Rows: median ms per step and tokens/s, MB read per step and the expert cache's
hit rate (ours), and, per engine of ours, how the steps routed (the smallest share of a layer's
experts used, the largest consecutive overlap, the most steps one expert served). --per-expert adds
rows with the grouped kernel switched off (one call set per routed expert, the reference). --model
takes a benchmark model name (mlx_flash/bench/models.py: moe-8l, the Qwen3-30B-A3B shape's first 8
layers on synthetic weights) or a GGUF's path. --json writes the rows as a record (bench/record.py);
llama.cpp's row is left out where its binding is not installed (`make peers`).
Runs in this process, warm (no memory limit or dropped caches: python -m mlx_flash.bench memory measures those).
"""

import argparse
import os
import sys

import mlx_flash
from mlx_flash.bench import record, teacher_forced
from mlx_flash.bench.decode_pairs import peer_built
from mlx_flash.bench.models import NAMES, bench_model
from mlx_flash.calibrate import read_corpus
from mlx_flash.calibrate.routes import record_teacher_forced, routing_spread
from mlx_flash.errors import exit_status, first_paragraph


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench moe", description=first_paragraph(__doc__))
    p.add_argument(
        "--model", required=True, help=f"a MoE GGUF, or a name: {', '.join(NAMES)} (moe-8l: a synthetic MoE)"
    )
    p.add_argument("--backends", default="mlx,torch")
    p.add_argument("--weights-budget", default=None, help="ours: the weights budget (default: the automatic plan)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--per-expert", action="store_true", help="also run ours with the grouped kernel off")
    p.add_argument("--json", default=None, help="write the rows as a JSON record here")
    return exit_status(lambda: run(p.parse_args(argv), argv))


def run(a, argv: list[str] | None) -> None:
    header = record.bench_provenance("moe", argv)
    path = bench_model(a.model)
    rows = []
    ids = None
    for backend in a.backends.split(","):
        for grouped in (True, False) if a.per_expert else (True,):
            with mlx_flash.load(path, backend=backend, weights_budget=a.weights_budget, progress=False) as e:
                if ids is None:
                    ids = e.tokenizer.encode(read_corpus("wikipedia")[:20000])[: a.prompt_tokens + a.tokens]
                if not grouped:
                    e.ops.moe_experts = lambda *args: None  # this engine's ops only: the per-expert reference
                r = teacher_forced.ours(e, ids, a.prompt_tokens)
                spread = routing_spread(record_teacher_forced(e, ids, a.prompt_tokens), e.args.num_experts)
                r["used_min"] = min(x["used"] for x in spread)
                r["overlap_max"] = max(x["overlap"] for x in spread)
                r["top_max"] = max(x["top"] for x in spread)
            r["engine"] = f"ours, {backend}" + ("" if grouped else ", one call set per expert")
            rows.append(r)
            print(f"{r['engine']}: {r['tok_s']:.2f} tok/s", file=sys.stderr)
    peer = not a.no_llama_cpp and peer_built()
    if not a.no_llama_cpp and not peer:
        print("llama.cpp: llama-cpp-python is not installed (make peers); its row is left out", file=sys.stderr)
    if peer:
        r = teacher_forced.llama_cpp(path, ids, a.prompt_tokens, a.threads)
        r["engine"] = "llama.cpp (mmap)"
        rows.append(r)
    base = rows[-1]["tok_s"] if peer else None
    print(
        f"{len(ids) - a.prompt_tokens} teacher-forced tokens after {a.prompt_tokens}; weights budget "
        f"{a.weights_budget or 'auto'}\n"
        "| engine | ms/token | tok/s | x llama.cpp | MB read/token | hit rate | experts used/layer (min) | "
        "overlap (max) | top expert (max) |\n" + "|---" * 9 + "|"
    )
    for r in rows:
        x = f"{r['tok_s'] / base:.2f}" if base else "-"
        hit = "-" if r.get("hit_rate") is None else f"{r['hit_rate']:.1%}"
        mb = "-" if "mb_read" not in r else f"{r['mb_read']:.1f}"
        spread = (
            f"{r['used_min']:.0%} | {r['overlap_max']:.2f} | {r['top_max']:.0%}" if "used_min" in r else "- | - | -"
        )
        print(f"| {r['engine']} | {r['ms']:.1f} | {r['tok_s']:.2f} | {x} | {mb} | {hit} | {spread} |")
    if a.json:
        parts = dict(tokens=len(ids) - a.prompt_tokens, prompt_tokens=a.prompt_tokens)
        record.write(a.json, header, rows=rows, **parts, weights_budget=a.weights_budget, model=a.model)
