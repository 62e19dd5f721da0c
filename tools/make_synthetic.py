"""Write a synthetic store of a real large shape with random float16 weights (results from it are
synthetic: real bytes and read patterns, random weights, modelled activity).

    python tools/make_synthetic.py [--shape llama-2-7b] [--out DIR] [--layers N] [--seed 0]

Default output: <cache>/stores/synthetic-<shape>. Llama-2-7B is about 13.5 GB (8.7 GB of FFN bundles);
mixtral-8x7b is 2.9 GB of experts per layer (use --layers: tools/bench_experts.py --synthetic replays
routing over however many layers there are).
"""

import argparse
import os
import shutil
import sys

from mlx_flash.calibrate import SHAPES, make_synthetic_store
from mlx_flash.config import default_cache_dir
from mlx_flash.errors import FlashError, exit_status, first_paragraph


def main() -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=None, help="only the first N layers (a smaller store)")
    p.add_argument("--seed", type=int, default=0)
    return exit_status(lambda: run(p.parse_args()))


def run(a) -> None:
    out = a.out or os.path.join(default_cache_dir(), "stores", f"synthetic-{a.shape}")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    except OSError as e:
        raise FlashError(f"{out}: cannot create its directory ({e.strerror})") from None
    cfg = SHAPES[a.shape]
    L = a.layers or cfg["num_hidden_layers"]
    need = 2 * L * (3 * cfg["hidden_size"] * cfg["intermediate_size"] + 4 * cfg["hidden_size"] ** 2) \
        + 4 * cfg["vocab_size"] * cfg["hidden_size"]
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(out))).free
    if free < need * 1.05:
        raise FlashError(f"{out}: needs about {need / 1e9:.1f} GB, only {free / 1e9:.1f} GB free")
    print(make_synthetic_store(out, a.shape, a.layers, a.seed, progress=True))


if __name__ == "__main__":
    sys.exit(main())
