"""Quality of KV chunk compression on long real text: perplexity and next-token agreement with
full-precision KV for static 8/4/2-bit chunks and tolerance-aware compression, with the bytes each
stores; a table, JSON and a plot.

    python -m mlx_flash.bench kv-compression [--model PATH] [--backend torch|mlx] [--corpus wikipedia]
        [--context 2048] [--tokens 8192] [--schemes off,static:8,static:4,static:2,tolerance:0.5]
        [--json OUT] [--plot OUT.png]
"""

import argparse
import sys

import numpy as np

from mlx_flash.api import load
from mlx_flash.calibrate import read_corpus
from mlx_flash.calibrate.kv_compression import kv_quality
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.service.compression import Compression
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench kv-compression", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="store dir, GGUF or HF dir (default: the default model)")
    p.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    p.add_argument("--corpus", default="wikipedia", choices=("wikipedia", "austen"))
    p.add_argument("--context", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--turn", type=int, default=128, help="tokens fed between compressions (default 128)")
    p.add_argument("--tokens", type=int, default=8192, help="score the first N tokens (default 8192)")
    p.add_argument("--schemes", default="off,static:8,static:4,static:2,tolerance:0.5")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    try:
        schemes = [Compression.parse(s) for s in a.schemes.split(",")]
        engine = load(a.model, backend=a.backend, progress=False)
        ids = engine.tokenizer.encode(read_corpus(a.corpus))[: a.tokens]
        rows = [kv_quality(engine, ids, c, a.context, a.turn, progress=True) for c in schemes]
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    base = next((r for r in rows if r["compression"] == "off"), rows[0])
    print(f"{a.corpus}, {len(ids)} tokens, windows of {a.context}, turns of {a.turn}, {a.backend}")
    print("| KV chunks | mean bits | bytes vs float32 | perplexity | vs full precision | next token agrees |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["agreement"] = float(np.mean(r["picks"] == base["picks"]))
        r["delta"] = r["perplexity"] / base["perplexity"] - 1
        bits = "32 (float)" if r["compression"] == "off" else f"{r['mean_bits']:.2f}"
        print(
            f"| {r['compression']} | {bits} | {r['bytes_vs_float32']:.1%} | {r['perplexity']:.3f} | "
            f"{r['delta']:+.2%} | {r['agreement']:.1%} |"
        )
    out = [{k: v for k, v in r.items() if k != "picks"} for r in rows]
    if a.json:
        write_json(a.json, out, OutputError, indent=1)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for r in out:
            ax.scatter(100 * r["bytes_vs_float32"], r["perplexity"], s=40)
            ax.annotate(
                r["compression"],
                (100 * r["bytes_vs_float32"], r["perplexity"]),
                fontsize=8,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.set_xlabel("KV bytes stored, % of float32")
        ax.set_ylabel(f"perplexity ({a.corpus})")
        ax.set_title("KV chunk compression: quality against bytes")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    return 0
