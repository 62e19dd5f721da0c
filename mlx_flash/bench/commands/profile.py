"""Where a torch decode step of the default model (or --model) spends its time, and whether capturing
the step with torch.compile pays.

    python -m mlx_flash.bench profile [--model PATH] [--tokens 32] [--compile] [--json FILE]

Three measurements on one engine (backend torch, float32, the stored bytes): the eager step's wall
time a token (median after warm-up); the self time of each operator inside the step from torch's
profiler (our kernels under mlx_flash::, torch's own under aten::), so what is left is Python; and
with --compile, the same step through torch.compile(dynamic=True): the time of its first call (the
compile) and its wall time a token afterwards. The prompt is a fixed 150-token text; every token is
the greedy choice of the one before (what decode does).
"""

import argparse
import contextlib
import statistics
import sys
import time

import numpy as np

import mlx_flash
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError


def _steps(engine, step, prompt_ids, tokens: int, around=contextlib.nullcontext) -> list[float]:
    """Wall time of each of `tokens` decode steps after the prompt, through `step(tokens, caches)`;
    `around()` encloses the steps, not the prompt."""
    caches = engine.new_caches()
    token = int(np.argmax(engine.prefill(prompt_ids, caches)))
    times = []
    with around():
        for _ in range(tokens):
            t = time.perf_counter()
            with engine.ops.inference():
                logits = step(engine.ops.tokens([token]), caches)
            token = int(logits[0, -1].argmax())
            times.append(time.perf_counter() - t)
    return times


def profile(engine, prompt_ids, tokens: int, compile_step: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def eager(ids, caches):
        return engine.module.forward(engine.ops, engine.args, engine.weights, ids, caches, engine.ffn)

    warm = min(8, tokens // 4)
    out = {"eager_ms": 1e3 * statistics.median(_steps(engine, eager, prompt_ids, tokens)[warm:])}
    prof = torch_profile(activities=[ProfilerActivity.CPU])
    _steps(engine, eager, prompt_ids, tokens, lambda: prof)
    events = prof.key_averages()
    per_token = {e.key: (e.self_cpu_time_total / tokens / 1e3, e.count // tokens) for e in events}
    out["operators"] = sorted(([k, ms, n] for k, (ms, n) in per_token.items()), key=lambda r: -r[1])
    out["kernels_ms"] = sum(ms for k, (ms, _) in per_token.items() if k.startswith("mlx_flash::"))
    out["torch_ops_ms"] = sum(ms for k, (ms, _) in per_token.items() if k.startswith("aten::"))
    if compile_step:
        compiled = torch.compile(eager, dynamic=True)
        times = _steps(engine, compiled, prompt_ids, tokens + 1)
        out["compile_s"] = times[0]
        out["compiled_ms"] = 1e3 * statistics.median(times[1 + warm :])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlx_flash.bench profile", description=first_paragraph(__doc__))
    ap.add_argument("--model", help="a GGUF file or store (default: the default model)")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed (the first quarter, at most 8, warm up)")
    ap.add_argument("--compile", action="store_true", help="also time the step through torch.compile")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args(argv)
    if args.tokens < 4:
        print("error: --tokens must be at least 4", file=sys.stderr)
        return 2
    try:
        with mlx_flash.load(args.model, backend="torch", progress=False) as engine:
            ids = engine.encode_prompt("The history of the city begins in the year " * 15)[:150]
            res = profile(engine, ids, args.tokens, args.compile)
    except (FlashError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"eager step: {res['eager_ms']:.2f} ms a token (wall, median)")
    print(
        f"inside the profiled step: our kernels {res['kernels_ms']:.2f} ms, torch's ops {res['torch_ops_ms']:.2f} ms "
        "a token (self time; the profiler adds its own cost around each call)"
    )
    print("| operator | ms a token | calls a token |\n|---|---|---|")
    for name, ms, n in res["operators"][:12]:
        print(f"| {name} | {ms:.3f} | {n} |")
    if args.compile:
        print(
            f"torch.compile(dynamic=True): first call {res['compile_s']:.1f} s, "
            f"then {res['compiled_ms']:.2f} ms a token "
            f"(eager {res['eager_ms']:.2f})"
        )
    if args.json:
        write_json(args.json, res, OutputError, indent=1)
    return 0
