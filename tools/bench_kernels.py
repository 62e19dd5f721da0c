"""Sparse FFN kernels (mlx_flash.kernels.sparse_ffn and its Metal and CUDA members), llm.c dev/cuda
style: reference, check, then time.

    python tools/bench_kernels.py [--shapes 7b,7b-14336,default] [--bits 4,8] [--sparsity 0,25,50,75,90]
                                  [--layers 32] [--rounds 5] [--threads N] [--syncs] [--json OUT] [--plot OUT.png]

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
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mlx_flash.backends import cpu_threads
from mlx_flash.errors import first_paragraph
from mlx_flash.kernels.slab_spec import SlabSpec
from mlx_flash.kernels.sparse_ffn import CpuSparseFFN, silu_mul, slab_matrices
from mlx_flash.kernels.sparse_ffn_ref import random_slab, sparse_down_ref, sparse_gate_up_ref

SHAPES = {"7b": (4096, 11008), "7b-14336": (4096, 14336), "default": (576, 1536)}
BLOCK = 32


def layers_of(shape: str, bits: int, layers: int) -> tuple[list[np.ndarray], SlabSpec]:
    """`layers` distinct slabs (one random layer copied: every page touched) and their spec."""
    D, F = SHAPES[shape]
    slab, spec = random_slab(np.random.default_rng(0), F // BLOCK, D, BLOCK, bits)
    return [slab] + [slab.copy() for _ in range(layers - 1)], spec


def per_layer_s(fn, slabs, rounds: int) -> float:
    """Median over rounds of one pass over every slab, divided by the slab count (after a warm pass)."""
    for s in slabs:
        fn(s)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for s in slabs:
            fn(s)
        times.append((time.perf_counter() - t) / len(slabs))
    return statistics.median(times)


def copy_gbs(slabs, nbytes: int, threads: int, rounds: int, pool: ThreadPoolExecutor) -> float:
    """GB/s copying the first `nbytes` of each slab in rotation into one destination, split over
    `threads` threads (numpy releases the GIL while copying)."""
    dst = np.empty(nbytes, np.uint8)
    cuts = [nbytes * i // threads for i in range(threads + 1)]

    def copy(s):
        src = s.reshape(-1)[:nbytes]
        jobs = [pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in zip(cuts[1:-1], cuts[2:])]
        np.copyto(dst[cuts[0] : cuts[1]], src[cuts[0] : cuts[1]])
        for j in jobs:
            j.result()

    return nbytes / per_layer_s(copy, slabs, rounds) / 1e9


def check(run, slab, spec, x, count, rng, to_host=np.asarray) -> float:
    """Max abs error of gate_up and down against the reference on one slab, relative to max |ref|.
    run(slab, idx, count, h) -> (gate_up's h, down's y on the reference h), as the target holds them."""
    idx = rng.permutation(slab.shape[0]).astype(np.int32)
    h_ref = sparse_gate_up_ref(x, slab, idx, count, spec)
    y_ref = sparse_down_ref(h_ref, slab, idx, count, spec)
    h, y = run(slab, idx, count, h_ref.astype(np.float32))
    h, y = to_host(h)[:, : count * spec.block], to_host(y)
    return max(
        float(np.abs(h - h_ref).max() / np.abs(h_ref).max()), float(np.abs(y - y_ref).max() / np.abs(y_ref).max())
    )


def bench_cpu(args, pool) -> list[dict]:
    rows = []
    threads = args.threads
    for shape in args.shapes:
        for bits in args.bits:
            slabs, spec = layers_of(shape, bits, args.layers)
            S, D = slabs[0].shape[0], spec.d_model
            k = CpuSparseFFN(spec, threads)
            rng = np.random.default_rng(1)
            x = rng.standard_normal((1, D)).astype(np.float32)
            err = check(lambda s, i, c, h: (k.gate_up(x, s, i, c), k.down(h, s, i, c)), slabs[0], spec, x, S // 2, rng)
            views = {id(s): slab_matrices(s, spec) for s in slabs}

            def dense(s):
                g, u, d = views[id(s)]
                d(silu_mul(g(x, threads), u(x, threads)), threads)

            t_dense = per_layer_s(dense, slabs, args.rounds)
            for sp in args.sparsity:
                count = int(round((1 - sp / 100) * S))
                idx = rng.permutation(S).astype(np.int32)

                def sparse(s):
                    k.down(k.gate_up(x, s, idx, count), s, idx, count)

                t = per_layer_s(sparse, slabs, args.rounds) if count else float("nan")
                nbytes = count * spec.bytes_per_bundle()
                copy = copy_gbs(slabs, nbytes, threads, args.rounds, pool) if count else float("nan")
                gbs = nbytes / t / 1e9
                rows.append(
                    dict(
                        target="cpu",
                        shape=shape,
                        d_model=D,
                        d_ff=S * BLOCK,
                        bits=bits,
                        sparsity=sp,
                        ms=t * 1e3,
                        gbs=gbs,
                        copy_gbs=copy,
                        of_copy=gbs / copy,
                        dense_ms=t_dense * 1e3,
                        speedup=t_dense / t,
                        max_rel_error=err,
                        threads=threads,
                    )
                )
                print(table_row(rows[-1]), flush=True)
            views.clear()  # free this shape's layers before the next one is built
            slabs.clear()
    return rows


def bench_metal(args) -> list[dict]:
    import mlx.core as mx

    if not mx.metal.is_available():
        print("metal: not run: no Metal device")
        return []
    from mlx_flash.kernels.metal_sparse import MetalSparseFFN

    rows = []
    for shape in args.shapes:
        for bits in args.bits:
            slabs_np, spec = layers_of(shape, bits, args.layers)
            S, D = slabs_np[0].shape[0], spec.d_model
            k = MetalSparseFFN(spec)
            rng = np.random.default_rng(1)
            x = rng.standard_normal((1, D)).astype(np.float32)
            xm = mx.array(x)

            def run(s, i, c, h):
                sm, im, cm = mx.array(s), mx.array(i), mx.array([c], mx.int32)
                return k.gate_up(xm, sm, im, cm), k.down(mx.array(h), sm, im, cm)

            err = check(run, slabs_np[0], spec, x, S // 2, rng, to_host=np.array)
            slabs = [mx.array(s) for s in slabs_np]
            del slabs_np
            # dense baseline: mx.quantized_matmul over each layer's gate|up and down, as MLX holds them
            dense_w = []
            for _ in range(args.layers):
                w = mx.random.normal((3 * S * BLOCK, D)) * 0.02
                dense_w.append(mx.quantize(w, group_size=32, bits=bits))
            mx.eval(dense_w)

            def dense_pass():
                out = []
                for wq, sc, bi in dense_w:
                    out.append(
                        mx.quantized_matmul(
                            xm.astype(mx.float16), wq, sc.astype(mx.float16), bi.astype(mx.float16), True, 32, bits
                        )
                    )
                mx.eval(out)

            t_dense = timed_passes(dense_pass, args.rounds) / args.layers
            for sp in args.sparsity:
                count = int(round((1 - sp / 100) * S))
                idx, cnt = mx.array(rng.permutation(S).astype(np.int32)), mx.array([count], mx.int32)

                def sparse_pass():
                    mx.eval([k.down(k.gate_up(xm, s, idx, cnt), s, idx, cnt) for s in slabs])

                t = timed_passes(sparse_pass, args.rounds) / args.layers
                nbytes = count * spec.bytes_per_bundle()

                def copy_pass():
                    mx.eval([mx.array(s.reshape(-1)[:nbytes]) + 0 for s in slabs])

                copy = nbytes / (timed_passes(copy_pass, args.rounds) / args.layers) / 1e9 if count else float("nan")
                gbs = nbytes / t / 1e9
                rows.append(
                    dict(
                        target="metal",
                        shape=shape,
                        d_model=D,
                        d_ff=S * BLOCK,
                        bits=bits,
                        sparsity=sp,
                        ms=t * 1e3,
                        gbs=gbs,
                        copy_gbs=copy,
                        of_copy=gbs / copy,
                        dense_ms=t_dense * 1e3,
                        speedup=t_dense / t,
                        max_rel_error=err,
                        threads=0,
                    )
                )
                print(table_row(rows[-1]), flush=True)
    return rows


def timed_passes(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_cuda(args) -> list[dict]:
    try:
        import torch
    except ImportError:
        print("cuda: not run: torch is not installed")
        return []
    if not torch.cuda.is_available():
        print("cuda: not run: no CUDA device")
        return []
    from mlx_flash.kernels.cuda_sparse import CudaSparseFFN

    dev = torch.device("cuda")
    rows = []
    for shape in args.shapes:
        for bits in args.bits:
            slabs_np, spec = layers_of(shape, bits, args.layers)
            S, D = slabs_np[0].shape[0], spec.d_model
            k = CudaSparseFFN(spec)
            rng = np.random.default_rng(1)
            x = rng.standard_normal((1, D)).astype(np.float32)
            xt = torch.from_numpy(x).to(dev)

            def run(s, i, c, h):
                st, it = torch.from_numpy(s).to(dev), torch.from_numpy(i).to(dev)
                ct = torch.tensor([c], dtype=torch.int32, device=dev)
                h_all = torch.zeros((h.shape[0], S * spec.block), device=dev)  # down takes h of every slot
                h_all[:, : h.shape[1]] = torch.from_numpy(h).to(dev)
                return k.gate_up(xt, st, it, ct), k.down(h_all, st, it, ct)

            err = check(run, slabs_np[0], spec, x, S // 2, rng, to_host=lambda t: t.cpu().numpy())
            slabs = [torch.from_numpy(s).to(dev) for s in slabs_np]
            del slabs_np

            def cuda_time(fn) -> float:  # per layer: back-to-back launches over the rotation, CUDA events
                fn()
                times = []
                for _ in range(args.rounds):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b) / 1e3 / args.layers)
                return statistics.median(times)

            all_idx, all_cnt = (
                torch.arange(S, dtype=torch.int32, device=dev),
                torch.tensor([S], dtype=torch.int32, device=dev),
            )
            t_dense = cuda_time(
                lambda: [k.down(k.gate_up(xt, s, all_idx, all_cnt), s, all_idx, all_cnt) for s in slabs]
            )
            for sp in args.sparsity:
                count = int(round((1 - sp / 100) * S))
                idx = torch.from_numpy(rng.permutation(S).astype(np.int32)).to(dev)
                cnt = torch.tensor([count], dtype=torch.int32, device=dev)
                t = cuda_time(lambda: [k.down(k.gate_up(xt, s, idx, cnt), s, idx, cnt) for s in slabs])
                nbytes = count * spec.bytes_per_bundle()
                dst = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
                copy = (
                    nbytes / cuda_time(lambda: [dst.copy_(s.view(-1)[:nbytes]) for s in slabs]) / 1e9
                    if count
                    else float("nan")
                )
                gbs = nbytes / t / 1e9
                rows.append(
                    dict(
                        target="cuda",
                        shape=shape,
                        d_model=D,
                        d_ff=S * BLOCK,
                        bits=bits,
                        sparsity=sp,
                        ms=t * 1e3,
                        gbs=gbs,
                        copy_gbs=copy,
                        of_copy=gbs / copy,
                        dense_ms=t_dense * 1e3,
                        speedup=t_dense / t,
                        max_rel_error=err,
                        threads=0,
                    )
                )
                print(table_row(rows[-1]), flush=True)
    return rows


def syncs(tokens: int, runs: int = 3) -> list[dict]:
    """Host syncs per decode token and decode tokens/s (median of `runs` loads, configurations taking
    turns) of the default model, MLX sparse mode, with the CPU sparse kernel and the reference path."""
    import mlx_flash

    configs = [(p, k) for p in ("dense", "statistical") for k in ("auto", "reference")]
    seen = {c: [] for c in configs}
    for _ in range(runs):
        for predictor, kernel in configs:
            kw = {"statistical_active": 0.5} if predictor == "statistical" else {}
            flash = mlx_flash.FlashOptions(mode="all", predictor=predictor, kernel=kernel, **kw)
            with mlx_flash.load(backend="mlx", ffn="sparse", weights_budget="200%", flash=flash, progress=False) as e:
                ids = e.tokenizer.encode("The capital of France is")
                caches = e.new_caches()
                e.prefill(ids, caches)
                tok = ids[-1]
                for _ in range(3):  # warm-up
                    tok = int(np.argmax(e.forward([tok], caches)[-1]))
                before, t = e.ops.host_syncs, time.perf_counter()
                for _ in range(tokens):
                    tok = int(np.argmax(e.forward([tok], caches)[-1]))
                dt = time.perf_counter() - t
                st = e.ffn.stats()
                seen[(predictor, kernel)].append(
                    dict(
                        predictor=predictor,
                        kernel=st.sparse_kernel,
                        layers=len(st.cached_rows),
                        syncs_per_token=(e.ops.host_syncs - before) / tokens,
                        tok_s=tokens / dt,
                    )
                )
    out = []
    for c in configs:
        row = dict(seen[c][0], tok_s=statistics.median(r["tok_s"] for r in seen[c]), runs=runs)
        out.append(row)
        print(
            f"syncs: predictor {row['predictor']:11s} kernel {row['kernel']:9s} {row['syncs_per_token']:6.1f} host "
            f"syncs/token ({row['syncs_per_token'] / row['layers']:.1f} per layer), {row['tok_s']:.1f} tok/s "
            f"(median of {runs})",
            flush=True,
        )
    return out


HEADER = (
    f"{'target':6s} {'shape':9s} {'bits':>4s} {'sparsity':>8s} {'ms/layer':>9s} {'GB/s':>6s} {'copy GB/s':>9s} "
    f"{'of copy':>7s} {'dense ms':>8s} {'speedup':>7s} {'max rel err':>11s}"
)


def table_row(r: dict) -> str:
    return (
        f"{r['target']:6s} {r['shape']:9s} {r['bits']:4d} {r['sparsity']:7d}% {r['ms']:9.3f} {r['gbs']:6.1f} "
        f"{r['copy_gbs']:9.1f} {r['of_copy']:7.0%} {r['dense_ms']:8.3f} {r['speedup']:6.2f}x {r['max_rel_error']:11.1e}"
    )


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=first_paragraph(__doc__))
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
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.plot and rows:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
