"""Regenerate the results pages: run a tier's benchmarks, each writing its JSON record into
docs/results/records/, then rewrite every generated table of docs/results/*.md from the records
(mlx_flash/bench/results.py says which benchmark feeds which table).

    python -m mlx_flash.bench results [--tier quick|full] [--only RECORD,...] [--render]

quick (`make results`): the default model and Gemma 3 270M, under 10 minutes on 2 cores. full: large
shapes on synthetic weights (the Llama-2-7B shape resident and inside a 2 GB memory cgroup, the LLMS
trace, the server under 16 clients, a MoE shape fed by real text, the throughput mode in a 2.4 GB
cgroup; root and cgroup v1 for the cgroups; the synthetic GGUFs and their stores are written first when absent,
about 21 GB), about 20 minutes. --render rewrites the pages from the records
there, running nothing. Take the machine to yourself: every figure is a speed. Without llama.cpp
(`make peers`) its columns say "peer not built".
"""

from __future__ import annotations

import argparse
import sys
import time

from mlx_flash.bench import results
from mlx_flash.bench.decode_pairs import peer_built
from mlx_flash.errors import FlashError, first_paragraph


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench results", description=first_paragraph(__doc__))
    p.add_argument("--tier", default=results.QUICK, choices=(results.QUICK, results.FULL))
    p.add_argument("--only", default=None, help="comma list of the tier's records to run (default: all of them)")
    p.add_argument("--render", action="store_true", help="rewrite the pages from the records there; run nothing")
    a = p.parse_args(argv)
    try:
        where = results.results_dir()
        failed = []
        if not a.render:
            if not peer_built():
                print("llama.cpp is not built (make peers): its columns will say 'peer not built'", file=sys.stderr)
            t0 = time.monotonic()
            failed = results.run_tier(where, a.tier, a.only.split(",") if a.only else None)
            print(f"the {a.tier} tier ran in {(time.monotonic() - t0) / 60:.1f} min")
        changed = results.render(where)
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"pages rewritten: {', '.join(changed) or 'none changed'}")
    if failed:
        print(f"error: {len(failed)} benchmark(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
