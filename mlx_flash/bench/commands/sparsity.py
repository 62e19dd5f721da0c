"""Activation sparsity measured (TEAL thresholds, load(..., sparsity=s)): what each level costs in
quality on held-out text and gains in decode speed against the dense model, in the same run. One JSON
record (mlx_flash/bench/record.py) with a part per --parts (mlx_flash/bench/sparsity_parts.py):

    python -m mlx_flash.bench sparsity [--parts thresholds,quality,decode] [--models default,gemma]
        [--levels 0,0.25,0.4,0.5,0.6] [--backends torch,mlx] [--pairs 5] [--gen-tokens 64]
        [--decode-prompt 64] [--calibration-tokens 8192] [--allocate 512] [--recalibrate] [--peer]
        [--threads 2]
        [--json bench_results/sparsity.json]

- thresholds: each model's thresholds, measured on the Austen novels and shared among the inputs by
  the greedy search over --allocate more tokens (0: every input at the model-wide level), as
  python -m mlx_flash.sparsify does, when its store has none, or with --recalibrate.
- quality: per level, perplexity over the first 4,096 Wikipedia tokens in windows of 512 with every
  row thresholded (each token scored as a decode step computes it), and 24 greedy tokens after each of
  5 held-out prompts (the prompt dense, every new token's step thresholded) against the dense model's:
  how many are equal, and the tokens they share before they differ.
- decode: per backend, --pairs interleaved pairs of each level's decode (a --decode-prompt prompt, then
  --gen-tokens greedy tokens) against the dense model's, and the thresholded products' counters: the
  share of inputs zeroed and the bytes a token reads; with --peer, also the dense model against
  llama.cpp on the same GGUF.

--models: default, gemma, 7b (the Llama-2-7B shape on synthetic weights: its thresholds come from its
own activations on Austen, so its sparsity is a labelled stand-in for a trained model's) or a GGUF
path. Take the machine to yourself: the decode part is a speed.
"""

import argparse
import os
import sys

from mlx_flash.bench import sparsity_parts as parts_
from mlx_flash.bench.commands import chosen_parts, recorded
from mlx_flash.bench.models import bench_model
from mlx_flash.bench.record import bench_provenance, write
from mlx_flash.errors import first_paragraph

PARTS = ("thresholds", "quality", "decode")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench sparsity", description=first_paragraph(__doc__))
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of: {', '.join(PARTS)}")
    p.add_argument("--models", default="default,gemma", help="comma list: default, gemma, 7b or GGUF paths")
    p.add_argument("--levels", default="0,0.25,0.4,0.5,0.6", help="sparsity levels (quality: the first is the base)")
    p.add_argument("--backends", default="torch,mlx")
    p.add_argument("--pairs", type=int, default=5, help="interleaved decode pairs (default 5)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--decode-prompt", type=int, default=64, help="tokens of the decode part's prompt")
    p.add_argument("--calibration-tokens", type=int, default=8192, help="Austen tokens the thresholds are set on")
    p.add_argument("--allocate", type=int, default=512, help="tokens of the thresholds' greedy allocation (0: uniform)")
    p.add_argument("--recalibrate", action="store_true", help="measure the thresholds even where a store has them")
    p.add_argument("--peer", action="store_true", help="decode: also the dense model against llama.cpp")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", default="bench_results/sparsity.json")
    a = p.parse_args(argv)
    parts = chosen_parts(a.parts, PARTS)
    if parts is None:
        return 2
    try:
        levels = [float(v) for v in a.levels.split(",")]
    except ValueError:
        print(f"error: --levels {a.levels!r} is not a comma list of numbers", file=sys.stderr)
        return 2
    header, record = bench_provenance("sparsity", argv), {}

    def fill() -> None:
        for part in parts:
            print(f"[{part}]", file=sys.stderr, flush=True)
            record[part] = {}
            for name in a.models.split(","):
                gguf = bench_model(name, skip_missing=True)
                if gguf is None:
                    continue
                label = parts_.model_label(name, gguf)
                print(f" {label}", file=sys.stderr, flush=True)
                if part == "thresholds":
                    record[part][label] = parts_.thresholds_part(
                        gguf, a.threads, a.calibration_tokens, a.allocate, a.recalibrate
                    )
                elif part == "quality":
                    record[part][label] = parts_.quality_part(gguf, levels, a.threads)
                else:
                    speed_levels = [v for v in levels if v > 0]
                    record[part][label] = parts_.decode_part(
                        gguf,
                        a.backends.split(","),
                        speed_levels,
                        a.threads,
                        a.pairs,
                        a.gen_tokens,
                        a.decode_prompt,
                        a.peer,
                    )
                write(a.json, header, **record)  # kept as it grows: a long run interrupted keeps its parts

    return recorded(a.json, header, record, fill)
