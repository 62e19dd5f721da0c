"""Sparse FFN kernels (mlx_flash.kernels.sparse_ffn and its Metal and CUDA members), llm.c dev/cuda
style: reference, check, then time.

    python -m mlx_flash.bench sparse-kernels [--shapes 7b,7b-14336,default] [--bits 4,8]
                                             [--sparsity 0,25,50,75,90] [--layers 32] [--rounds 5] [--threads N]
                                             [--syncs] [--json OUT] [--plot OUT.png]

Per shape (d_model x d_ff, in the store's default layout: bundles of 32 neurons, 4/8-bit codes in
groups of 32, float16 scales), bits and target: each kernel is first checked against the plain-ops
reference on one layer, then timed over --layers layers' worth of distinct slabs in rotation (so no
cache level holds them; 7B: 32 x 85 MB at 4 bits) for each sparsity (the share of bundles inactive,
a random set in random slot order). Reported per layer: milliseconds, GB/s on the bytes the call
must read (the active bundles' gate, up and down codes, scales and biases), that rate as a share of
the copy bandwidth measured in the same run on buffers of the same size (the same rotation,
the kernel's thread count; GB/s = bytes copied per second), and the speedup over the dense
quantized matvec of the same layer (CPU: the CPU kernel over every row; Metal: mx.quantized_matmul;
CUDA: the kernel with every slot active). Targets without their hardware print "not run".

--syncs runs the default model on MLX in sparse mode with the CPU sparse kernel and with the
reference path, counting host syncs (lazy arrays turned into host memory) per decode token and
measuring decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mlx_flash.backends import cpu_threads
from mlx_flash.bench.sparse_kernels import HEADER, SHAPES, bench_cpu, bench_cuda, bench_metal, syncs, table_row
from mlx_flash.errors import first_paragraph
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = sorted({(r["target"], r["shape"], r["bits"]) for r in rows})
    for key in keys:
        rs = [r for r in rows if (r["target"], r["shape"], r["bits"]) == key and r["sparsity"] < 100]
        sp = [r["sparsity"] for r in rs]
        label = f"{key[0]} {key[1]} {key[2]}-bit"
        (line,) = a.plot(sp, [r["speedup"] for r in rs], marker="o", label=label)
        b.plot(sp, [r["gbs"] for r in rs], marker="o", color=line.get_color(), label=label)
        b.plot(sp, [r["copy_gbs"] for r in rs], ls=":", color=line.get_color())
    xs = np.linspace(0, 90, 50)
    a.plot(xs, 1 / (1 - xs / 100), "k:", label="bytes ratio 1/(1-s)")
    a.set(
        xlabel="sparsity (% of bundles inactive)",
        ylabel="speedup over the dense matvec",
        yscale="log",
        title="sparse FFN layer vs dense",
    )
    b.set(
        xlabel="sparsity (% of bundles inactive)",
        ylabel="GB/s",
        ylim=(0, None),
        title="GB/s on the bytes read (solid), copy (dotted)",
    )
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlx_flash.bench sparse-kernels", description=first_paragraph(__doc__))
    ap.add_argument("--shapes", default="7b,7b-14336,default")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--sparsity", default="0,25,50,75,90")
    ap.add_argument("--layers", type=int, default=32, help="distinct layers timed in rotation")
    ap.add_argument("--rounds", type=int, default=5, help="passes over the rotation (median)")
    ap.add_argument("--threads", type=int, default=cpu_threads())
    ap.add_argument("--targets", default="cpu,metal,cuda")
    ap.add_argument("--syncs", action="store_true", help="also count host syncs per token on the default model")
    ap.add_argument("--sync-tokens", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--from-json", help="reprint the table and redraw the plot of an earlier --json run")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            rows = json.load(fh)["rows"]
        print(HEADER)
        for r in rows:
            print(table_row(r))
        if args.plot and rows:
            plot(rows, args.plot)
        return 0
    try:
        args.shapes = [s for s in args.shapes.split(",") if s]
        bad = [s for s in args.shapes if s not in SHAPES]
        if bad:
            raise ValueError(f"--shapes: {', '.join(bad)} unknown (choose from {', '.join(SHAPES)})")
        args.bits = [int(b) for b in args.bits.split(",")]
        args.sparsity = [int(s) for s in args.sparsity.split(",")]
        if any(b not in (4, 8) for b in args.bits) or any(not 0 <= s < 100 for s in args.sparsity):
            raise ValueError("--bits takes 4 and 8, --sparsity percentages in [0, 100)")
        if args.layers < 1 or args.rounds < 1 or args.threads < 1:
            raise ValueError("--layers, --rounds and --threads must be >= 1")
    except ValueError as e:
        print(f"bench_kernels: {e}", file=sys.stderr)
        return 2
    print(HEADER)
    rows = []
    targets = args.targets.split(",")
    with ThreadPoolExecutor(max(1, args.threads - 1)) as pool:
        if "cpu" in targets:
            rows += bench_cpu(args, pool)
    if "metal" in targets:
        rows += bench_metal(args)
    if "cuda" in targets:
        rows += bench_cuda(args)
    result = {"rows": rows, "threads": args.threads, "layers": args.layers, "rounds": args.rounds}
    if args.syncs:
        result["syncs"] = syncs(args.sync_tokens)
    if args.json:
        write_json(args.json, result, OutputError, indent=1)
    if args.plot and rows:
        plot(rows, args.plot)
    return 0
