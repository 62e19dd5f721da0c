"""How many contexts one KV budget holds with each compression scheme: compressed chunks are held in
the pool at their width, so a narrower scheme keeps more contexts wholly in memory. Each context is
its own slice of a corpus; a table (contexts held, against static 8-bit, the chunk widths chosen)
and JSON.

    python -m mlx_flash.bench kv-capacity [--model PATH] [--backend torch|mlx] [--corpus wikipedia]
        [--kv-budget 128MB] [--contexts 24] [--prompt-tokens 512] [--new-tokens 8]
        [--schemes off,static:8,static:4,tolerance:0.45] [--json OUT]
"""

import argparse
import sys

from mlx_flash.api import load
from mlx_flash.bench.kv_capacity import contexts_held
from mlx_flash.calibrate import read_corpus
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.budget import parse_budget
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench kv-capacity", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="store dir, GGUF or HF dir (default: the default model)")
    p.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    p.add_argument("--corpus", default="wikipedia", choices=("wikipedia", "austen"))
    p.add_argument("--kv-budget", default="128MB", help="the service's KV budget (default 128MB)")
    p.add_argument("--contexts", type=int, default=24, help="contexts made, one call each (default 24)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens of text per context (default 512)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per call (default 8)")
    p.add_argument("--schemes", default="off,static:8,static:4,tolerance:0.45")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        budget = parse_budget(a.kv_budget, 0, "KV budget")
        engine = load(a.model, backend=a.backend, progress=False)
        ids = engine.tokenizer.encode(read_corpus(a.corpus))
        rows = [
            contexts_held(engine, ids, budget, s, a.contexts, a.prompt_tokens, a.new_tokens)
            for s in a.schemes.split(",")
        ]
    except (FlashError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    base = next((r for r in rows if r["compression"] == "static:8"), None)
    print(
        f"{a.corpus}: {a.contexts} contexts of {a.prompt_tokens} + {a.new_tokens} tokens, KV budget {a.kv_budget}, "
        f"{a.backend}"
    )
    print("| KV chunks | contexts held | vs static:8 | float slots | arena used | chunk widths (bits: chunks) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        vs = f"{r['contexts_held'] / base['contexts_held']:.2f}x" if base and base["contexts_held"] else "-"
        used = f"{r['arena_used'] / 1e6:.1f} of {r['arena_bytes'] / 1e6:.1f} MB" if r["arena_bytes"] else "-"
        mix = ", ".join(f"{w}: {n}" for w, n in r["chunk_widths"].items())
        print(f"| {r['compression']} | {r['contexts_held']} | {vs} | {r['float_slots']} | {used} | {mix} |")
    if a.json:
        write_json(a.json, rows, OutputError, indent=1)
    return 0
