"""Write a synthetic checkpoint of a real large shape with random weights: a store with float16
weights (--format store, the default) or a GGUF in a real block quantization (--format gguf).
Results from either are synthetic: real bytes, layout and read patterns, random weights.

    python tools/make_synthetic.py [--shape llama-2-7b] [--out DIR] [--layers N] [--seed 0]
    python tools/make_synthetic.py --format gguf [--shape llama-2-7b] [--quant Q4_1|Q4_0|Q8_0] [--layers N]
                                   [--out FILE] [--seed 0]

Store: default output <cache>/stores/synthetic-<shape>. Llama-2-7B is about 13.5 GB (8.7 GB of FFN
bundles); mixtral-8x7b is 2.9 GB of experts per layer, qwen3-30b-a3b 1.2 GB (use --layers:
`python -m mlx_flash.bench experts --synthetic` replays routing over however many layers there are).

GGUF: default output <cache>/synthetic/<shape>-<quant>[-L<layers>].gguf, default quant Q4_1. Every
matrix (token_embd, output and every expert included) holds random blocks of the quant, scaled so
that weights stay within about +-0.02 and a deep forward pass stays finite; norms are float32 ones;
the tokenizer metadata is the default model's (SmolLM2's 49152-token BPE, which replaces the shape's
vocabulary size). llama-2-7b is written as llama.cpp's `llama` architecture (about 4.3 GB in Q4_1),
qwen3-30b-a3b as its `qwen3moe` (128 experts per layer as 3-D tensors, random float32 routers; about
18.8 GB in Q4_1, 0.39 GB per layer); mixtral-8x7b is store-only. llama.cpp loads the file and
`python -m mlx_flash.convert FILE OUT` converts it. Written in chunks: the writer's memory stays small.
"""

import argparse
import os
import shutil
import sys

from mlx_flash.calibrate import SHAPES, make_synthetic_store, write_synthetic_gguf
from mlx_flash.calibrate.synthetic_gguf import QUANTS
from mlx_flash.config import default_cache_dir
from mlx_flash.errors import FlashError, exit_status, first_paragraph


def main() -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument(
        "--format",
        default="store",
        choices=("store", "gguf"),
        help="store: float16 store (default); gguf: a quantized GGUF checkpoint",
    )
    p.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    p.add_argument("--quant", default=None, choices=list(QUANTS), help="GGUF block quantization (default Q4_1)")
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=None, help="only the first N layers (a smaller checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    return exit_status(lambda: run(p.parse_args()))


def run(a) -> None:
    if a.format == "gguf":
        print(write_synthetic_gguf(a.out, a.shape, a.quant or "Q4_1", a.layers, a.seed, progress=True))
        return
    if a.quant is not None:
        raise FlashError("--quant applies to --format gguf only (a synthetic store holds float16 weights)")
    out = a.out or os.path.join(default_cache_dir(), "stores", f"synthetic-{a.shape}")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    except OSError as e:
        raise FlashError(f"{out}: cannot create its directory ({e.strerror})") from None
    cfg = SHAPES[a.shape]
    L = a.layers or cfg["num_hidden_layers"]
    D, attn = cfg["hidden_size"], (cfg["num_attention_heads"] + cfg["num_key_value_heads"]) * cfg["head_dim"]
    need = 2 * L * (3 * D * cfg["intermediate_size"] + 2 * D * attn) + 4 * cfg["vocab_size"] * D
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(out))).free
    if free < need * 1.05:
        raise FlashError(f"{out}: needs about {need / 1e9:.1f} GB, only {free / 1e9:.1f} GB free")
    print(make_synthetic_store(out, a.shape, a.layers, a.seed, progress=True))


if __name__ == "__main__":
    sys.exit(main())
