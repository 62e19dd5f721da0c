"""Decode and prefill speed of the default model (or --model) per backend, median of N runs.

    python -m mlx_flash.bench decode [--model PATH] [--prompt-tokens 128] [--gen-tokens 128] [--runs 5]
                                     [--configs mlx,torch,torch-bf16,torch-stream] [--json bench_results/bench.json]

Each run: prefill a prompt of --prompt-tokens real Wikipedia tokens (or a repeated sentence when the
corpus is not fetched), then greedy-decode exactly --gen-tokens tokens (EOS ignored). llama.cpp is
measured the same way through llama-cpp-python when that package is installed (same GGUF, same
threads); otherwise its column says "not installed".
"""

import argparse
import os
import sys

import mlx_flash
from mlx_flash.bench.decode_pairs import engine_run, llama_run, medians, open_llama, prompt_text
from mlx_flash.default_model import default_model_path
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError

CONFIGS = {
    "mlx": dict(backend="mlx"),
    "torch": dict(backend="torch", torch_dtype="float32"),
    "mlx-q8": dict(backend="mlx", arithmetic="q8"),
    "torch-q8": dict(backend="torch", torch_dtype="float32", arithmetic="q8"),
    "torch-bf16": dict(backend="torch", torch_dtype="bfloat16"),
    "torch-stream": dict(backend="torch", torch_dtype="float32", ffn="stream"),
    "mlx-stream": dict(backend="mlx", ffn="stream"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench decode", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument(
        "--configs",
        default="mlx,torch,torch-bf16",
        help=f"comma list of: {', '.join(CONFIGS)}, or llama.cpp alone (the peer only, in its own tokens)",
    )
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp column")
    p.add_argument("--json", default="bench_results/bench.json")
    a = p.parse_args(argv)
    results, ids = {}, None
    names = a.configs.split(",")
    peer_only = names == ["llama.cpp"]
    try:
        for name in [] if peer_only else names:
            if name not in CONFIGS:
                raise FlashError(f"--configs: unknown config {name!r} (choose from {', '.join(CONFIGS)})")
            kw = dict(CONFIGS[name])
            if kw["backend"] == "torch":
                kw["threads"] = a.threads
            with mlx_flash.load(a.model, progress=True, **kw) as engine:
                ids = engine.tokenizer.encode(prompt_text())[: a.prompt_tokens]
                print(f"[{name}] {engine.ops.describe()}", file=sys.stderr)
                results[name] = medians(lambda: engine_run(engine, ids, a.gen_tokens), a.runs)
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if peer_only or (not a.no_llama_cpp and ids is not None):
        gguf = a.model if a.model and a.model.endswith(".gguf") else default_model_path()
        llm = open_llama(gguf, a.prompt_tokens + a.gen_tokens + 16, a.threads)
        if llm is None:
            results["llama.cpp"] = "not installed"
        else:
            if ids is None:  # the peer alone: the same text in its own tokens
                ids = llm.tokenize(prompt_text().encode())[: a.prompt_tokens]
            results["llama.cpp"] = medians(lambda: llama_run(llm, ids, a.gen_tokens), a.runs)
    print(f"\nprompt {a.prompt_tokens} tokens, generate {a.gen_tokens}, median of {a.runs} runs, {a.threads} threads")
    print(f"{'config':<14}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"{name:<14}{r:>30}")
        else:
            print(f"{name:<14}{r['prefill_tps']:>15.1f}{r['decode_tps']:>15.1f}")
    if isinstance(results.get("llama.cpp"), dict):
        ref = results["llama.cpp"]["decode_tps"]
        for name, r in results.items():
            if name != "llama.cpp" and isinstance(r, dict):
                print(
                    f"decode ratio {name} / llama.cpp = {r['decode_tps'] / ref:.2f}; prefill ratio "
                    f"{r['prefill_tps'] / results['llama.cpp']['prefill_tps']:.2f} "
                    f"({len(ids) / r['prefill_tps']:.2f} s against "
                    f"{len(ids) / results['llama.cpp']['prefill_tps']:.2f} s)"
                )
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        write_json(
            a.json,
            {
                "prompt_tokens": a.prompt_tokens,
                "gen_tokens": a.gen_tokens,
                "runs": a.runs,
                "threads": a.threads,
                "results": results,
            },
            OutputError,
            indent=1,
        )
        print(f"wrote {a.json}")
    return 0
