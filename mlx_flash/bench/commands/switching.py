"""The switching benchmark where switching costs: long contexts (2-4k tokens of Wikipedia each) on a
large model, more than the KV budget holds, visited in a Zipf trace of `--switches` visits of
`--turns` calls each. Ours (LLMS: chunk eviction, ahead-of-time swap-out, read and recompute at
once) beside whole-context swap at the same compression and recompute (drop the KV, prefill again;
on the trace's first `--recompute-switches` switches). The KV budget holds `--kv-contexts` contexts
at the compression's width. Table and JSON.

    python -m mlx_flash.bench switching --model FILE_OR_STORE [--backend torch|mlx] [--contexts 6]
        [--min-tokens 2048] [--max-tokens 4096] [--switches 12] [--turns 2] [--kv-contexts 2]
        [--compression tolerance:0.5] [--prefill-chunk 128] [--recompute-switches 3]
        [--variants ours,whole,recompute] [--dir DIR] [--reuse] [--json OUT]
"""

import argparse
import os
import sys
import tempfile

from mlx_flash.api import load
from mlx_flash.bench.service_trace import Variant
from mlx_flash.bench.switching_trace import SwitchTrace, build, load_built, replay, visits
from mlx_flash.calibrate import read_corpus
from mlx_flash.errors import ConfigError, FlashError, first_paragraph
from mlx_flash.service.lifecycle import Evict, Lifecycle, Restore
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError


def variants(compression: str) -> list[Variant]:
    return [
        Variant(f"ours (LLMS, {compression})", Lifecycle(), compression),
        Variant(
            f"whole-context swap ({compression})",
            Lifecycle(Evict.WHOLE_CONTEXT, Restore.READ, ahead=False),
            compression,
        ),
        Variant("recompute (drop, prefill again)", Lifecycle(Evict.DROP, Restore.RECOMPUTE, ahead=False)),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench switching", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None)
    p.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    d = SwitchTrace()
    p.add_argument("--contexts", type=int, default=d.contexts)
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--switches", type=int, default=d.switches)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--zipf", type=float, default=d.zipf_s, help="the Zipf exponent s (weights 1 / rank^s)")
    p.add_argument(
        "--kv-contexts",
        type=float,
        default=d.kv_contexts,
        help="KV budget in contexts of the mean starting length, held at the compression's width",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=128,
        help="prompt tokens per pass (default 128): a quarter of a compressed budget is float slots, "
        "which must hold one pass's new chunks",
    )
    p.add_argument("--think", type=float, default=d.think_s, help="mean idle seconds between calls")
    p.add_argument("--compression", default="tolerance:0.5", help="ours and whole-context swap (kv_compression)")
    p.add_argument("--recompute-switches", type=int, default=3)
    p.add_argument("--variants", default="ours,whole,recompute", help="which to run (default: all three)")
    p.add_argument("--dir", default=None, help="where the build and the runs live (default: a temporary folder)")
    p.add_argument("--reuse", action="store_true", help="replay the build an earlier run left in --dir/build")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    base = a.dir or tempfile.mkdtemp(prefix="bench-switching-")
    rows = []
    try:
        trace = SwitchTrace(
            a.contexts,
            a.min_tokens,
            a.max_tokens,
            a.switches,
            a.turns,
            zipf_s=a.zipf,
            kv_contexts=a.kv_contexts,
            think_s=a.think,
        )
        keys = dict(zip(("ours", "whole", "recompute"), variants(a.compression)))
        unknown = set(a.variants.split(",")) - set(keys)
        if unknown:
            raise ConfigError(f"--variants takes ours, whole, recompute (not {', '.join(sorted(unknown))})")
        engine = load(a.model, backend=a.backend, prefill_chunk=a.prefill_chunk, progress=False)
        build_dir = os.path.join(base, "build")
        if a.reuse:
            built = load_built(build_dir)
        else:
            built = build(
                engine,
                read_corpus("wikipedia"),
                trace,
                build_dir,
                a.compression,
                progress=lambda s: print("build: " + s, flush=True),
            )
        print(
            f"{len(built.ids)} contexts of {min(built.tokens)}-{max(built.tokens)} tokens ({sum(built.tokens)} in all, "
            f"built in {built.build_s:.0f} s), KV budget {built.kv_budget / 1e9:.2f} GB; trace: {trace.switches} Zipf "
            f"(s={trace.zipf_s}) switches x {trace.turns} turns of {trace.call_tokens} new + {trace.generate} "
            f"generated tokens; visits {visits(trace)}",
            flush=True,
        )
        for v in (keys[k] for k in a.variants.split(",")):
            n = a.recompute_switches if v.lifecycle.evict is Evict.DROP else None
            r = replay(engine, v, trace, built, os.path.join(base, "run"), switches=n).summary()
            rows.append(r)
            print(
                f"{v.name:44s} {r['switches']:3d} switches: mean {r['switch_mean_s']:8.3f} s, p50 "
                f"{r['switch_p50_s']:8.3f} s; TTFT {r['ttft_mean_s']:8.3f} s; read {r['chunks_read']}, recomputed "
                f"{r['chunks_recomputed']}, written {r['chunks_written']}; {r['seconds']:.0f} s",
                flush=True,
            )
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    ours = rows[0]["switch_mean_s"]  # (the first variant run: ours unless --variants says otherwise)
    print("\n| variant | switches | mean switch (s) | p50 (s) | x ours | mean TTFT (s) | chunks read | recomputed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['switches']} | {r['switch_mean_s']:.3f} | {r['switch_p50_s']:.3f} | "
            f"{r['switch_mean_s'] / ours:.1f}x | {r['ttft_mean_s']:.3f} | {r['chunks_read']} | "
            f"{r['chunks_recomputed']} |"
        )
    if a.json:
        write_json(
            a.json,
            {"trace": vars(trace), "visits": visits(trace), "tokens": built.tokens, "rows": rows},
            OutputError,
            indent=1,
        )
    return 0
