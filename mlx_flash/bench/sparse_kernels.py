"""The sparse FFN kernels measured (`python -m mlx_flash.bench sparse-kernels`): each target (the CPU
kernel, its Metal and CUDA members) checked against the plain-ops reference on one layer, then timed
over layers' worth of distinct slabs in rotation per shape, bits and sparsity, beside a copy of as
many bytes; and the default model's host syncs per decode token in sparse mode. The command's
docstring (mlx_flash/bench/commands/sparse_kernels.py) says what each column means."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from ..api import load
from .timing import median_seconds
from ..options import FlashOptions
from ..kernels.cuda_sparse import CudaSparseFFN
from ..kernels.metal_sparse import MetalSparseFFN
from ..kernels.slab_spec import SlabSpec
from ..kernels.sparse_ffn import CpuSparseFFN, silu_mul, slab_matrices
from ..kernels.sparse_ffn_ref import random_slab, sparse_down_ref, sparse_gate_up_ref

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
                rows.append(result_row("cpu", shape, D, S * BLOCK, bits, sp, t, nbytes, copy, t_dense, err, threads))
                print(table_row(rows[-1]), flush=True)
            views.clear()  # free this shape's layers before the next one is built
            slabs.clear()
    return rows


def bench_metal(args) -> list[dict]:
    if not mx.metal.is_available():
        print("metal: not run: no Metal device")
        return []
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

            t_dense = median_seconds(dense_pass, args.rounds) / args.layers
            for sp in args.sparsity:
                count = int(round((1 - sp / 100) * S))
                idx, cnt = mx.array(rng.permutation(S).astype(np.int32)), mx.array([count], mx.int32)

                def sparse_pass():
                    mx.eval([k.down(k.gate_up(xm, s, idx, cnt), s, idx, cnt) for s in slabs])

                t = median_seconds(sparse_pass, args.rounds) / args.layers
                nbytes = count * spec.bytes_per_bundle()

                def copy_pass():
                    mx.eval([mx.array(s.reshape(-1)[:nbytes]) + 0 for s in slabs])

                copy = nbytes / (median_seconds(copy_pass, args.rounds) / args.layers) / 1e9 if count else float("nan")
                rows.append(result_row("metal", shape, D, S * BLOCK, bits, sp, t, nbytes, copy, t_dense, err, 0))
                print(table_row(rows[-1]), flush=True)
    return rows


def result_row(target, shape, D, d_ff, bits, sparsity, t, nbytes, copy, t_dense, err, threads) -> dict:
    """One table row: a sparse step of t seconds per layer reading nbytes, against a copy of them
    (copy GB/s) and the dense step (t_dense)."""
    gbs = nbytes / t / 1e9
    return dict(
        target=target,
        shape=shape,
        d_model=D,
        d_ff=d_ff,
        bits=bits,
        sparsity=sparsity,
        ms=t * 1e3,
        gbs=gbs,
        copy_gbs=copy,
        of_copy=gbs / copy,
        dense_ms=t_dense * 1e3,
        speedup=t_dense / t,
        max_rel_error=err,
        threads=threads,
    )


def bench_cuda(args) -> list[dict]:
    try:
        import torch
    except ImportError:
        print("cuda: not run: torch is not installed")
        return []
    if not torch.cuda.is_available():
        print("cuda: not run: no CUDA device")
        return []
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
                rows.append(result_row("cuda", shape, D, S * BLOCK, bits, sp, t, nbytes, copy, t_dense, err, 0))
                print(table_row(rows[-1]), flush=True)
    return rows


def syncs(tokens: int, runs: int = 3) -> list[dict]:
    """Host syncs per decode token and decode tokens/s (median of `runs` loads, configurations taking
    turns) of the default model, MLX sparse mode, with the CPU sparse kernel and the reference path."""
    configs = [(p, k) for p in ("dense", "statistical") for k in ("auto", "reference")]
    seen = {c: [] for c in configs}
    for _ in range(runs):
        for predictor, kernel in configs:
            kw = {"statistical_active": 0.5} if predictor == "statistical" else {}
            flash = FlashOptions(mode="all", predictor=predictor, kernel=kernel, **kw)
            with load(backend="mlx", ffn="sparse", weights_budget="200%", flash=flash, progress=False) as e:
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
