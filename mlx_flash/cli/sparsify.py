"""Measure a model's activation-sparsity thresholds (TEAL) on calibration text and save them beside
its store, so that `load(model, sparsity=0.4)` and `python -m mlx_flash.chat --sparsity 0.4` can
skip the weights of each product's smallest inputs.

    python -m mlx_flash.sparsify [MODEL] [--corpus austen] [--tokens 8192] [--context 512] [--allocate 512]
        [--precision P]
    (installed as the console script mlx-flash-sparsify)

MODEL is what the chat takes (default: the default model; a GGUF, a store, a model folder or a hub
name). The model runs dense and resident over the first --tokens tokens of the corpus (the Austen
novels; python tools/fetch_data.py fetches them), and the magnitude of every product's input is
counted per layer; any level from 0 to 95% then reads its thresholds from those counts. A greedy search
(TEAL's) then shares each model-wide level among the inputs: from all dense, it raises by 10% the
level of the input that costs the least loss on the next --allocate tokens per share of the weights
it skips. What each level costs on held-out text: docs/results/sparsity.md (python -m mlx_flash.bench
sparsity).
"""

import argparse
import sys

from ..errors import FlashError, first_paragraph


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.sparsify", description=first_paragraph(__doc__))
    p.add_argument("model", nargs="?", default=None, help="model (default: the default model)")
    p.add_argument("--corpus", default="austen", choices=("austen", "wikipedia"), help="calibration text")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    p.add_argument("--context", type=int, default=512, help="tokens per window, each from an empty cache")
    p.add_argument(
        "--allocate",
        type=int,
        default=512,
        help="tokens of the greedy search that shares a model-wide level among the inputs, after the "
        "calibration's (default 512; 0: every input at the model-wide level, for models too slow to search)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        help="the store's precision, as the chat takes it (ffn sparse reads a source-neuron store: its own thresholds)",
    )
    a = p.parse_args(argv)
    if a.tokens < a.context or a.context < 2:
        print(
            f"error: --tokens ({a.tokens}) must be at least --context ({a.context}), which must be >= 2",
            file=sys.stderr,
        )
        return 2
    from ..calibrate import thresholds  # deferred: offline code, loaded for this command only

    try:
        path = thresholds.sparsity_thresholds(
            a.model, a.corpus, a.tokens, a.context, precision=a.precision, allocate=a.allocate
        )
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
