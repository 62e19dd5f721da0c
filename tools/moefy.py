"""Derive a real-weights MoE from a dense model (MoEfication): cluster each layer's FFN neurons into
experts by co-activation on the Austen text, train a top-k router, write an HF-style directory, and
report its perplexity on Wikipedia next to the dense model's. The result is a derived model.

    python tools/moefy.py [--model PATH] [--experts 16] [--top-k 8] [--out DIR] [--calib-tokens 16384]

Default output: <cache>/models/<model>-moefied-E<experts>K<top-k>; load it like any model
(`mlx_flash.load(DIR, ...)`, `--model DIR`).
"""

import argparse
import json
import os
import sys

import mlx_flash
from mlx_flash.calibrate import moefy, perplexity, read_corpus
from mlx_flash.config import default_cache_dir
from mlx_flash.default_model import default_model_path
from mlx_flash.errors import exit_status, first_paragraph


def main() -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="dense GGUF or HF dir (default: the default model)")
    p.add_argument("--experts", type=int, default=16, help="experts per layer (default 16)")
    p.add_argument("--top-k", type=int, default=8, help="experts each token runs (default 8)")
    p.add_argument("--out", default=None)
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument(
        "--block",
        type=int,
        default=None,
        help="neurons move between experts in blocks this big (default: the source's quantization group)",
    )
    p.add_argument("--epochs", type=int, default=30, help="router training epochs (default 30)")
    p.add_argument("--ppl-tokens", type=int, default=4096, help="Wikipedia tokens scored (default 4096)")
    return exit_status(lambda: run(p.parse_args()))


def run(a) -> None:
    source = a.model or default_model_path()
    name = os.path.splitext(os.path.basename(os.path.abspath(source)))[0]
    out = a.out or os.path.join(default_cache_dir(), "models", f"{name}-moefied-E{a.experts}K{a.top_k}")
    report = moefy(source, out, read_corpus("austen"), a.experts, a.top_k, a.calib_tokens, a.block, epochs=a.epochs)
    wiki = read_corpus("wikipedia")
    ppl = {}
    for label, model, precision in (("dense", source, "f16"), ("moefied", out, "source")):
        with mlx_flash.load(model, backend="torch", precision=precision) as eng:
            ppl[label] = perplexity(eng, wiki, 512, a.ppl_tokens, progress=True)["perplexity"]
    report.update(perplexity_wikipedia=ppl, out=out)
    with open(os.path.join(out, "moefication.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    rec = sum(r["oracle_recall"] for r in report["router"]) / len(report["router"])
    print(
        f"derived MoE (E={a.experts}, top-{a.top_k}) written to {out}\n"
        f"mean router recall of the oracle experts {rec:.3f}\n"
        f"perplexity on Wikipedia ({a.ppl_tokens} tokens): dense {ppl['dense']:.3f}, "
        f"derived MoE {ppl['moefied']:.3f} ({ppl['moefied'] / ppl['dense'] - 1:+.1%})"
    )


if __name__ == "__main__":
    sys.exit(main())
