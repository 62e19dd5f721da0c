"""Perplexity of a model or store on a text file.

    python tools/perplexity.py [--model PATH] [--backend mlx|torch] [--text FILE | --corpus wikipedia]
                               [--ffn resident|stream|sparse] [--predictor-recall R]
                               [--context 512] [--tokens 4096] [--json OUT]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx_flash  # noqa: E402
from mlx_flash.corpora import corpus_path  # noqa: E402
from mlx_flash.errors import FlashError  # noqa: E402
from mlx_flash.perplexity import perplexity  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="store dir, GGUF or HF dir (default: the default model)")
    p.add_argument("--backend", default="mlx", choices=("mlx", "torch"))
    p.add_argument("--torch-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--ffn", default="resident", choices=("resident", "stream", "sparse"))
    p.add_argument("--sparse-mode", default="all", help="with --ffn sparse (naive/hybrid/predictor/window/all)")
    p.add_argument("--memory-budget", default="100%", help="with --ffn sparse (default 100%%: quality only)")
    p.add_argument("--predictor", default="lowrank", choices=("lowrank", "gate", "dense"))
    p.add_argument("--down-only", action="store_true",
                   help="with --predictor gate: read only down columns; gate/up come from its 4-bit copy")
    p.add_argument("--predictor-recall", type=float, default=None, help="predictor cut calibrated for this recall")
    p.add_argument("--precision", default="source", help="FFN precision when converting (source, f16, q4, q8)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", default=None, help="a UTF-8 text file")
    src.add_argument("--corpus", default="wikipedia", choices=("wikipedia", "austen"),
                     help="a fetched corpus (tools/fetch_data.py); default: wikipedia")
    p.add_argument("--context", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--tokens", type=int, default=4096, help="score the first N tokens (default 4096)")
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    a = p.parse_args()
    try:
        path = a.text or corpus_path(a.corpus)
        if not os.path.isfile(path):
            raise FlashError(f"{path}: no such text file")
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        engine = mlx_flash.load(a.model, backend=a.backend, ffn=a.ffn, torch_dtype=a.torch_dtype,
                                precision=a.precision, sparse_mode=a.sparse_mode, memory_budget=a.memory_budget,
                                predictor=a.predictor, predictor_recall=a.predictor_recall,
                                down_only=a.down_only)
        r = perplexity(engine, text, a.context, a.tokens, progress=True)
    except (FlashError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.ffn == "sparse":
        r.update(sparse_mode=a.sparse_mode, predictor=a.predictor, predictor_recall=a.predictor_recall,
                                down_only=a.down_only)
    r.update(backend=a.backend, torch_dtype=a.torch_dtype, ffn=a.ffn, text=os.path.basename(path),
             store=engine.store.path, precision=engine.store.manifest.ffn.precision)
    print(f"perplexity {r['perplexity']:.4f} over {r['scored']} tokens (context {a.context}, {a.backend})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
