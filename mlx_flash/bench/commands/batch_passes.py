"""What one batched pass costs on this machine: decode steps of 1..32 rows (in one block buffer, and
with --chunked-rows as the server holds them, in a chunk pool), prefill passes of 1..4 prompts packed
into one, and the weight products alone for B rows (--products: the layers' products and the
output head's apart; the tokens/s the batched products allow, what python -m mlx_flash.bench concurrency's
aggregate rate is held against) and with --attention every layer's attention of a server decode
step of B rows alone; medians, tokens/s and GFLOP/s (mlx_flash/bench/batch_passes.py).

    python -m mlx_flash.bench batch-passes [--model M] [--backend torch|mlx] [--rows 1,8,32] [--prompts 1,4]
        [--prompt-tokens 128] [--chunked-rows 16] [--products 16] [--attention 16] [--threads N]
"""

import argparse
import sys

import mlx_flash
from mlx_flash.bench.batch_passes import (
    attention_pass,
    chunked_decode_step,
    decode_step,
    head_pass,
    prefill_pass,
    products_pass,
)
from mlx_flash.errors import FlashError, first_paragraph


def ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each number must be >= 1")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench batch-passes", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="store, GGUF or HF dir (default: the default model)")
    p.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    p.add_argument("--rows", type=ints, default=[1, 8, 32], help="decode rows (default 1,8,32)")
    p.add_argument("--prompts", type=ints, default=[1, 4], help="prompts in one prefill pass (default 1,4)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens of each prompt (default 128)")
    p.add_argument("--chunked-rows", type=ints, default=[], help="rows of a chunk-pool decode step (e.g. 16)")
    p.add_argument("--products", type=ints, default=[], help="rows of a products-only pass (e.g. 1,16)")
    p.add_argument("--attention", type=ints, default=[], help="rows of a step's attention alone (e.g. 16)")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: the engine's)")
    args = p.parse_args(argv)
    try:
        kw = {} if args.threads is None else {"threads": args.threads}
        with mlx_flash.load(args.model, backend=args.backend, ffn="resident", progress=False, **kw) as engine:
            print(f"{engine.store.path} ({args.backend}, weights resident)")
            for r in args.rows:
                print(decode_step(engine, r).line(), flush=True)
            for r in args.chunked_rows:
                print(chunked_decode_step(engine, r).line(), flush=True)
            for r in args.prompts:
                print(prefill_pass(engine, r, args.prompt_tokens).line(), flush=True)
            for r in args.products:
                layers, head = products_pass(engine, r), head_pass(engine, r)
                both = layers.seconds + head.seconds
                print(layers.line(), flush=True)
                print(head.line(), flush=True)
                print(f"{'products with the head':28s} {both * 1e3:8.1f} ms  {r / both:8.0f} tok/s", flush=True)
            for r in args.attention:
                print(attention_pass(engine, r).line(), flush=True)
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
