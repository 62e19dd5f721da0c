"""The LLMS trace benchmark: context switching latency and time to first token of 16 contexts built
from real text, called in the Random / Markov / Gaussian patterns with Poisson arrivals under a KV
budget holding 25% of their KV: LLMS against LMK (drop and recompute), whole-context swap, vLLM-S
(chunks, LRU) and vLLM-SQ (+ static 8-bit), and LLMS with each technique ablated. Also a context at
the model's full length: ready again from flash against its re-prefill. Table, JSON and a plot.

    python -m mlx_flash.bench service [--model NAME|GGUF] [--backend torch|mlx]
        [--patterns random,markov,gaussian] [--contexts 16] [--context-tokens 512] [--calls 48]
        [--variants NAME,...] [--full-context] [--json OUT] [--plot OUT.png] [--from-json IN]

--model: a name of mlx_flash/bench/models.py (default, gemma, ...) or a GGUF. --json writes a record
(mlx_flash/bench/record.py: commit, CPU, versions, command, load before and after) with the parts
config, model, backend, rows and full_context; result_tables_service.service renders it as a table.
"""

import argparse
import json
import os
import sys
import tempfile

from mlx_flash.api import load
from mlx_flash.calibrate import read_corpus
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.bench.models import NAMES, bench_model
from mlx_flash.bench.record import bench_provenance, write
from mlx_flash.bench.result_tables_service import service as service_table
from mlx_flash.bench.service_trace import PATTERNS, VARIANTS, TraceConfig, build_texts, full_context_restore, run_trace


def plot(rows, names, patterns, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 4.6))
    w = 0.8 / len(names)
    for k, name in enumerate(names):
        vals = [
            next(x for x in rows if x["variant"] == name and x["pattern"] == pt)["switch_mean_ms"] for pt in patterns
        ]
        ax.bar(np.arange(len(patterns)) + k * w, vals, w, label=name)
    ax.set_xticks(np.arange(len(patterns)) + w * (len(names) - 1) / 2, patterns)
    ax.set_yscale("log")
    ax.set_ylabel("mean context switching latency (ms, log)")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench service", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help=f"{', '.join(NAMES)} or a GGUF (default: the default model)")
    p.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    p.add_argument("--contexts", type=int, default=16)
    p.add_argument("--context-tokens", type=int, default=512)
    p.add_argument("--calls", type=int, default=48)
    p.add_argument("--kv-share", type=float, default=0.25)
    p.add_argument("--full-context", action="store_true", help="also time a full-length context's restore")
    p.add_argument("--dir", default=None, help="service directory for the runs (default: a temporary one)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--from-json", default=None, help="reprint the table and plot of an earlier run's --json")
    a = p.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as fh:
            old = json.load(fh)
        rows = old["rows"]
        names = list(dict.fromkeys(r["variant"] for r in rows))
        patterns = list(dict.fromkeys(r["pattern"] for r in rows))
        for r in rows:
            print(
                f"{r['pattern']:9s} {r['variant']:34s} switch {r['switch_mean_ms']:8.1f} ms  ttft "
                f"{r['ttft_mean_ms']:8.1f} ms"
            )
        print("\n" + service_table(old))
        if a.plot:
            plot(rows, names, patterns, a.plot)
        return 0
    names = a.variants.split(",")
    variants = [v for v in VARIANTS if v.name in names]
    if len(variants) != len(names):
        print(f"error: --variants takes names among: {', '.join(v.name for v in VARIANTS)}", file=sys.stderr)
        return 1
    header = bench_provenance("service", argv)
    cfg = TraceConfig(contexts=a.contexts, context_tokens=a.context_tokens, calls=a.calls, kv_share=a.kv_share)
    base = a.dir or tempfile.mkdtemp(prefix="bench-service-")
    rows, full = [], None
    try:
        model = bench_model(a.model) if a.model else None
        engine = load(model, backend=a.backend, progress=False)
        text = read_corpus("wikipedia")
        starts, pieces = build_texts(engine, text, cfg)
        for pattern in a.patterns.split(","):
            for v in variants:
                r = run_trace(engine, v, pattern, starts, pieces, cfg, os.path.join(base, "svc")).summary()
                rows.append(r)
                print(
                    f"{pattern:9s} {v.name:34s} switch {r['switch_mean_ms']:8.1f} ms  ttft {r['ttft_mean_ms']:8.1f} "
                    f"ms  read {r['chunks_read']:5d}  recomputed {r['chunks_recomputed']:5d}  written "
                    f"{r['chunks_written']:5d}",
                    flush=True,
                )
        if a.full_context:
            full = full_context_restore(engine, text, os.path.join(base, "full"))
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"\n{cfg.contexts} contexts of {cfg.context_tokens} tokens, {cfg.calls} calls of {cfg.call_tokens} new "
        f"tokens, KV budget {cfg.kv_share:.0%} of their KV, {a.backend}; mean switching latency (ms) and its "
        "ratio to LLMS, mean time to first token (ms)"
    )
    patterns = list(dict.fromkeys(r["pattern"] for r in rows))
    print("| variant | " + " | ".join(f"{p} switch | x | {p} TTFT" for p in patterns) + " |")
    print("|---|" + "---|---|---|" * len(patterns))
    for v in variants:
        cells = []
        for pt in patterns:
            r = next(x for x in rows if x["variant"] == v.name and x["pattern"] == pt)
            llms = next((x for x in rows if x["variant"] == "LLMS" and x["pattern"] == pt), None)
            ratio = r["switch_mean_ms"] / llms["switch_mean_ms"] if llms and llms["switch_mean_ms"] else float("nan")
            cells += [f"{r['switch_mean_ms']:.1f}", f"{ratio:.1f}x", f"{r['ttft_mean_ms']:.1f}"]
        print(f"| {v.name} | " + " | ".join(cells) + " |")
    if full:
        rc = full["recompute"]["seconds"]
        print(
            f"\nfull context ({full['tokens']} tokens) swapped to flash, ready again: pipeline "
            f"{full['pipeline']['seconds']:.3f} s ({full['pipeline']['read']} chunks read, "
            f"{full['pipeline']['recomputed']} recomputed), read only {full['read']['seconds']:.3f} s, "
            f"recompute {rc:.3f} s: {rc / full['pipeline']['seconds']:.1f}x faster than re-prefill"
        )
    if a.json:
        asked = a.model or "default"  # the record names the model as asked for, not this machine's path
        write(a.json, header, config=vars(cfg), model=asked, backend=a.backend, rows=rows, full_context=full)
    if a.plot and rows:
        plot(rows, [v.name for v in variants], patterns, a.plot)
    return 0
