"""Throughput benchmark (FlexGen mode): generated tokens/s of a block of sequences through a model
larger than its budget, one process per configuration (optionally inside a memory cgroup of the
budget, its peak and OOM kills read from the kernel). Configurations: (a) one sequence at a time
with today's streaming, (b) batched without the block schedule (row order), (c) the zig-zag
schedule with the searched policy, (d) = (c) on a 4-bit store converted from the same source,
and the ablations: no overlap, no policy search. Prints each policy's predicted time beside the
measured one; table, JSON and a plot.

    python -m mlx_flash.bench throughput [--store DIR] [--compressed-store DIR] [--label NAME]
        [--arithmetic auto|exact|q8] [--memory-budget 2GB] [--weights-share 0.3] [--sequences 32]
        [--prompt 128] [--generate 32]
        [--modes single,row,flexgen,naive,no-overlap] [--cgroup] [--json OUT] [--plot OUT.png]
    python -m mlx_flash.bench throughput --worker CONFIG_JSON     (one configuration, in this process)

--weights-share: the weights' budget as a share of the store's bytes (the rest of --memory-budget
holds the runtime, the block's KV cache and activations). --store takes a store, a GGUF (converted
into the store cache before the first configuration runs) or a benchmark model name
(mlx_flash/bench/models.py). The headline run, 32 sequences on the Mistral-7B layer shape (12 of its
32 layers, Q8_0, synthetic weights) in a 2.4 GB cgroup:

    python -m mlx_flash.bench throughput --store mistral-12l --label "Mistral-7B shape, 12 layers, Q8_0 (synthetic)"
        --sequences 32 --prompt 128 --generate 32 --single-sequences 1 --memory-budget 2.4GB --cgroup

--json writes the rows as a record (bench/record.py: where and what ran, then label, args, rows).
"""

import argparse
import json
import os
import subprocess
import sys

from mlx_flash.bench import record
from mlx_flash.bench.models import NAMES, bench_model
from mlx_flash.calibrate import read_corpus
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.bench.throughput import MODES, BenchConfig, against_single, run_config
from mlx_flash.bench.cgroup import MemoryCgroup
from mlx_flash.budget import parse_budget
from mlx_flash.config import default_cache_dir
from mlx_flash.default_model import resolve_store

LABELS = {
    "single": "(a) one at a time",
    "row": "(b) batched, row order",
    "flexgen": "(c) zig-zag + search",
    "compressed": "(d) (c) + 4-bit weights",
    "naive": "ablation: no search",
    "no-overlap": "ablation: no overlap",
}


def store_bytes(path):
    if path is None:
        return None
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith((".bin", ".safetensors")))


def as_store(name: str | None) -> str | None:
    """--store's directory: a benchmark model name's GGUF or a GGUF file converted into the store cache
    (once; the configurations then load the store, so no run times a conversion); None (the default
    model) and a store directory as they are."""
    if name is None:
        return None
    path = bench_model(name)
    return resolve_store(path, default_cache_dir(), "source", True) if os.path.isfile(path) else path


def run_one(cfg: BenchConfig, cgroup_limit) -> dict:
    cmd = [sys.executable, "-m", "mlx_flash.bench", "throughput", "--worker", json.dumps(cfg.__dict__)]
    if cgroup_limit:
        with MemoryCgroup(cgroup_limit) as cg:
            r = cg.run(cmd)
        extra = {"cgroup_limit": cg.limit, "cgroup_peak": r.peak, "oom_kills": r.oom_kills}
        code, out, err = r.returncode, r.stdout, r.stderr
    else:
        p = subprocess.run(cmd, capture_output=True, text=True)
        code, out, err, extra = p.returncode, p.stdout, p.stderr, {}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if code != 0 or not lines:
        return {"mode": cfg.mode, "error": (err.strip().splitlines() or [f"exit {code}"])[-1], **extra}
    return {**json.loads(lines[-1]), **extra}


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [LABELS.get(r["label"], r["label"]) for r in ok]
    ax.barh(names, [r["tokens_per_s"] for r in ok], label="measured")
    pred = [(r["predicted_tokens_per_s"], n) for r, n in zip(ok, names) if r.get("predicted_tokens_per_s")]
    if pred:
        ax.scatter(
            [p for p, _ in pred], [n for _, n in pred], color="k", marker="|", s=300, label="cost model", zorder=3
        )
    ax.set_xlabel("generated tokens/s (prefill included)")
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=8)
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench throughput", description=first_paragraph(__doc__))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--store", default=None, help=f"store dir, GGUF, or a name: {', '.join(NAMES)} (default: the default model)"
    )
    p.add_argument(
        "--compressed-store",
        default=None,
        help="the same source converted to 4 bits (--precision q4 --group-size 64): configuration (d)",
    )
    p.add_argument("--label", default=None, help="what the store is, for the table (say 'synthetic' for one)")
    p.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    p.add_argument("--arithmetic", default="auto", choices=("auto", "exact", "q8"), help="load(arithmetic=...)")
    p.add_argument("--memory-budget", default="auto")
    p.add_argument("--weights-share", type=float, default=0.3)
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--generate", type=int, default=32)
    p.add_argument("--single-sequences", type=int, default=4)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--cgroup", action="store_true", help="run each configuration in a memory cgroup of the budget")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    a.argv = argv  # the command as typed, for the record
    try:
        if a.worker is not None:
            print(json.dumps(run_config(BenchConfig(**json.loads(a.worker)), read_corpus("wikipedia"))), flush=True)
            return 0
        header = record.bench_provenance("throughput", a.argv)
        store = as_store(a.store)

        def weights_budget(store):
            n = store_bytes(store)
            if n is None:
                n = store_bytes(resolve_store(None, default_cache_dir(), "source", False))
            return str(int(n * a.weights_share))

        limit = parse_budget(a.memory_budget, 0) if a.cgroup and a.memory_budget != "auto" else None
        if a.cgroup and limit is None:
            raise FlashError("--cgroup needs --memory-budget in bytes (e.g. 2GB)")
        # inside a cgroup the engine's "auto" budget is the cgroup's limit (less the planner's margin)
        base = dict(
            backend=a.backend,
            arithmetic=a.arithmetic,
            memory_budget="auto" if a.cgroup else a.memory_budget,
            sequences=a.sequences,
            prompt=a.prompt,
            generate=a.generate,
            single_sequences=a.single_sequences,
        )
        runs = [
            (m, BenchConfig(mode=m, store=store, weights_budget=weights_budget(store), **base))
            for m in a.modes.split(",")
        ]
        if a.compressed_store:
            runs.insert(
                3,
                (
                    "compressed",
                    BenchConfig(
                        mode="flexgen", store=as_store(a.compressed_store), weights_budget=weights_budget(store), **base
                    ),
                ),
            )
        rows = []
        for label, cfg in runs:
            r = {"label": label, **run_one(cfg, limit)}
            rows.append(r)
            if "error" in r:
                print(f"{LABELS.get(label, label)}: error: {r['error']}", flush=True)
                continue
            pred = (
                (
                    f"predicted {r['predicted_s']:.1f} s / measured {r['seconds']:.1f} s "
                    f"({r['seconds'] / r['predicted_s']:.2f}x)"
                )
                if r.get("predicted_s")
                else ""
            )
            mem = f"peak {r['peak_rss'] / 2**20:.0f} MiB" + (
                f", cgroup peak {r['cgroup_peak'] / 2**20:.0f} MiB of "
                f"{r['cgroup_limit'] / 2**20:.0f}, {r['oom_kills']} OOM"
                if "cgroup_peak" in r
                else ""
            )
            print(
                f"{LABELS.get(label, label):26s} {r['tokens_per_s']:7.2f} tok/s  "
                f"decode {r['decode_tokens_per_s']:7.2f} "
                f"tok/s  prefill {r['prefill_s']:6.1f} s  read {r['bytes_read'] / 2**30:6.2f} GiB  {mem}  {pred}  "
                f"{json.dumps(r.get('policy')) if r.get('policy') else ''}",
                flush=True,
            )
        single = next((r for r in rows if r["label"] == "single" and "tokens_per_s" in r), None)
        for r in rows:
            if single and "tokens_per_s" in r:
                r["vs_single"] = r["tokens_per_s"] / single["tokens_per_s"]
                r["decode_vs_single"] = r["decode_tokens_per_s"] / single["decode_tokens_per_s"]
        if single:
            print(
                "vs (a): "
                + ", ".join(
                    f"{r['label']} {r['vs_single']:.1f}x (decode {r['decode_vs_single']:.1f}x)"
                    for r in rows
                    if "vs_single" in r
                )
            )
        for line in against_single(rows):
            print(line)
        if a.json:
            record.write(a.json, header, label=a.label, args=vars(a), rows=rows)
        if a.plot:
            plot(
                rows,
                a.plot,
                f"{a.label or a.store or 'default model'}: {a.sequences} sequences, prompt {a.prompt}, "
                f"generate {a.generate}, weights budget {a.weights_share:.0%} of the model",
            )
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
