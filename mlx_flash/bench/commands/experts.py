"""EdgeMoE benchmarks: the expert-cache policy table, and decode speed with cold reads (direct I/O).

    python -m mlx_flash.bench experts --policies --model MOE            hit rates, prefetch off
    python -m mlx_flash.bench experts --model MOE [--tokens 32] [--runs 3]  speed on a real MoE model
    python -m mlx_flash.bench experts --synthetic STORE [--tokens 16]    speed on a synthetic store, routing replayed

--policies replays the Wikipedia routing trace tools/trace_experts.py saved in the store
(routes-wikipedia.npy) through a cache of 1, 2, 4 and 8 experts per layer (shared by all layers),
token by token, for every policy and Belady's offline optimum.

Speed rows: after a prompt of the Wikipedia text, each decode step is fed the text's next token
(teacher forcing: routing follows real text); medians over the steps; I/O = time blocked on reads.
--runs N: every row N times, cold each time, in turn (run 1 of every row, then run 2, ...); medians.
  IO-EXP   float16 experts read when routed, no cache (slots for one layer's experts)
  IO-QEXP  all experts INT4 (<store>-int4), no cache
  Q        the expert-wise widths (<store>-mixP005, tools/expert_bits.py), no cache
  Q+P      Q, plus the next layer's predicted experts preloaded (slots for two layers)
  Q+P+C    Q+P with an expert cache of 25 / 50 / 100% of all experts (EdgeMoE: ours)
then, at the 25% cache: each eviction policy (edgemoe, lru, lfu) with the preloader off and on.
With --synthetic, the experts run on their own (no attention) over routing replayed from a MoE-fied
model's trace (pairs of its experts merged), and Q is all-INT4 (random weights have no importance).
"""

import argparse
import os
import statistics
import time

import numpy as np

import mlx_flash
from mlx_flash.calibrate import read_corpus
from mlx_flash.errors import FlashError, exit_status, first_paragraph
from mlx_flash.default_model import resolve_store
from mlx_flash.config import default_cache_dir
from mlx_flash.moe.policies import POLICIES
from mlx_flash.moe.policies import simulate
from mlx_flash.calibrate import decode_trace
from mlx_flash.models import llama
from mlx_flash.moe.experts import StreamedExperts
from mlx_flash.store.reader_pool import ReaderPool
from mlx_flash.backends import get_backend
from mlx_flash.calibrate import fit_routing_predictor
from mlx_flash.calibrate import write_expert_store
from mlx_flash.models.moe import ModelArgs
from mlx_flash.moe.routing import model_id
from mlx_flash.store import open_store

SHARES = (0.25, 0.5, 1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench experts", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="a MoE store (or HF dir) with a routing trace and predictor")
    p.add_argument("--policies", action="store_true", help="print the cache-policy table and stop")
    p.add_argument("--sizes", default="1,2,4,8", help="cache sizes, experts per layer (default 1,2,4,8)")
    p.add_argument("--int4", default=None, help="the all-INT4 store (default <store>-int4)")
    p.add_argument("--mixed", default=None, help="the expert-wise widths store (default <store>-mixP005)")
    p.add_argument(
        "--synthetic", default=None, help="a synthetic MoE store (tools/make_synthetic.py --shape mixtral-8x7b)"
    )
    p.add_argument("--routes", default=None, help="with --synthetic: a routes-wikipedia.npy to replay")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=1, help="--model: cold runs of every row, interleaved; medians")
    return exit_status(lambda: run(p.parse_args(argv)))


def run(a) -> None:
    if a.synthetic:
        return bench_synthetic(a)
    if not a.model:
        raise FlashError("--model is required (a MoE model, e.g. tools/moefy.py's output)")

    store = resolve_store(a.model, default_cache_dir())
    if a.policies:
        return policy_table(store, [int(s) for s in a.sizes.split(",")])
    bench_model(a, store)


def load_routes(store: str) -> np.ndarray:
    path = os.path.join(store, "routes-wikipedia.npy")
    if not os.path.isfile(path):
        raise FlashError(f"{path}: no routing trace (run tools/trace_experts.py --model {store})")
    return np.load(path)


def policy_table(store: str, sizes: list[int]) -> None:

    routes = load_routes(store)
    L, N, K = routes.shape
    trace = decode_trace(routes)
    print(f"expert-cache hit rate, prefetch off: {N} Wikipedia tokens decoded one by one, {L} layers, top-{K}\n")
    print("| experts cached per layer | " + " | ".join(POLICIES) + " |\n" + "|---" * (len(POLICIES) + 1) + "|")
    for s in sizes:
        rates = {p: simulate(trace, s * L, p, L)["hit_rate"] for p in POLICIES}
        print(f"| {s} ({s * L} slots) | " + " | ".join(f"{rates[p]:.1%}" for p in POLICIES) + " |")


# ---- speed on a real model ---------------------------------------------------------------------


def account_of(path: str) -> dict:
    with mlx_flash.load(
        path,
        backend="torch",
        ffn="stream",
        weights_budget="100%",
        progress=False,
        experts=mlx_flash.ExpertOptions(preload=0),
    ) as e:
        return dict(
            mlx_flash.memory_plan(e),
            n_layers=e.ffn.n_layers,
            n_experts=e.ffn.layout.n_experts,
            k=e.args.num_experts_per_tok,
        )


def decode_row(
    label: str, path: str, slots: int, preload: int, ids: list[int], prompt: int, acct: dict, policy="edgemoe"
):
    """Teacher-forced decode: the prompt's ids prefilled, then each next id of the text fed in turn
    (the model's own pick is not used), timed per step; blocked read and conversion time from the
    expert source's counters."""
    budget = acct["resident_weights"] + slots * acct["slot_bytes"]
    with mlx_flash.load(
        path,
        backend="torch",
        ffn="stream",
        weights_budget=budget,
        progress=False,
        experts=mlx_flash.ExpertOptions(policy=policy, preload=preload),
        io=mlx_flash.IOOptions(mode="direct"),
    ) as e:
        f = e.ffn
        caches = e.new_caches()
        b0 = f.stats().bytes_read
        e.prefill(ids[:prompt], caches)  # expert-major: what a prompt's pass reads
        prefill_mb = (f.stats().bytes_read - b0) / 1e6
        first = f.stats()
        walls, ios, mems, mbs = [], [], [], []
        for t in ids[prompt:]:
            s0, t0 = f.stats(), time.perf_counter()
            e.forward([t], caches)
            walls.append((time.perf_counter() - t0) * 1e3)
            s1 = f.stats()
            ios.append((s1.io_seconds - s0.io_seconds) * 1e3)
            mems.append((s1.mem_seconds - s0.mem_seconds) * 1e3)
            mbs.append((s1.bytes_read - s0.bytes_read) / 1e6)
        e.release(caches)
        last = f.stats()
        h, m = (sum(b) - sum(a) for a, b in zip(zip(*first.expert_hits), zip(*last.expert_hits)))
        med = statistics.median
        return {
            "label": label,
            "slots": last.expert_slots,
            "total_ms": med(walls),
            "io_ms": med(ios),
            "mem_ms": med(mems),
            "compute_ms": med([w - i - m for w, i, m in zip(walls, ios, mems)]),
            "mb": med(mbs),
            "hit": h / max(1, h + m),
            "useful": (last.preloaded_used - first.preloaded_used) / max(1, last.routed_experts - first.routed_experts),
            "withdrawn": last.preloads_withdrawn - first.preloads_withdrawn,
            "prefill_mb": prefill_mb,
            "prompt_tokens": prompt,
        }


def print_rows(rows: list[dict], base: dict) -> None:
    print(
        "| config | slots | ms/token | tok/s | vs IO-EXP | I/O ms | mem ms | compute ms | MB read | hit rate | "
        "preloaded |\n" + "|---" * 11 + "|"
    )
    for r in rows:
        print(
            f"| {r['label']} | {r['slots']} | {r['total_ms']:.1f} | {1e3 / r['total_ms']:.2f} | "
            f"{base['total_ms'] / r['total_ms']:.2f}x | {r['io_ms']:.1f} | {r['mem_ms']:.1f} | {r['compute_ms']:.1f} | "
            f"{r['mb']:.1f} | {r['hit']:.1%} | {r['useful']:.1%} |"
        )


def median_rows(specs: list[tuple], runs: int) -> list[dict]:
    """decode_row of every spec (its arguments), `runs` times in turn (run 1 of every row, then run 2,
    ...), so a slow minute falls on every row alike; each row's medians, its runs' ms/token kept."""
    done = [[decode_row(*spec) for spec in specs] for _ in range(runs)]
    rows = []
    for i in range(len(specs)):
        each = [d[i] for d in done]
        row = {k: statistics.median(r[k] for r in each) if isinstance(v, float) else v for k, v in each[0].items()}
        row["runs_ms"] = [r["total_ms"] for r in each]
        rows.append(row)
    return rows


def bench_model(a, store: str) -> None:
    int4 = a.int4 or store.rstrip("/") + "-int4"
    mixed = a.mixed or store.rstrip("/") + "-mixP005"
    for p in (int4, mixed):
        if not os.path.isdir(p):
            raise FlashError(f"{p}: no such store (run tools/expert_bits.py --model {store})")
    if a.runs < 1:
        raise FlashError(f"--runs {a.runs}: at least 1")
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        ids = e.tokenizer.encode(read_corpus("wikipedia")[20000:40000])[: a.prompt_tokens + a.tokens]
    acct = {p: account_of(p) for p in (store, int4, mixed)}
    L, E, K = acct[store]["n_layers"], acct[store]["n_experts"], acct[store]["k"]
    n, tf = a.prompt_tokens, (ids, a.prompt_tokens)
    specs = [
        ("IO-EXP (float16, no cache)", store, K, 0, *tf, acct[store]),
        ("IO-QEXP (INT4, no cache)", int4, K, 0, *tf, acct[int4]),
        ("Q", mixed, K, 0, *tf, acct[mixed]),
        ("Q+P", mixed, 2 * K, K, *tf, acct[mixed]),
    ]
    for share in SHARES:
        slots = max(2 * K, int(share * L * E))
        specs.append((f"Q+P+C, {share:.0%} of experts cached (ours)", mixed, slots, K, *tf, acct[mixed]))
    # the eviction policies and the preloader on this model, at the 25% cache
    slots = max(2 * K, int(SHARES[0] * L * E))
    policies = [
        (f"{policy}, preload {pre}", mixed, slots, pre, *tf, acct[mixed], policy)
        for policy in ("edgemoe", "lru", "lfu")
        for pre in (0, K)
    ]
    rows = median_rows(specs + policies, a.runs)
    rows, table = rows[: len(specs)], rows[len(specs) :]
    runs = f"medians of {a.runs} cold runs, interleaved" if a.runs > 1 else "one run"
    print(
        f"\n{a.tokens} tokens teacher-forced (each step fed the Wikipedia text's next token) after a {n}-token "
        f"prompt, cold reads (direct I/O), torch float32, {L} layers x {E} experts, top-{K}; {runs}\n"
    )
    print_rows(rows, rows[0])
    q, qp = rows[2], rows[3]
    print(
        f"\npreloading hid {1 - qp['io_ms'] / max(q['io_ms'], 1e-9):.0%} of Q's blocked read time "
        f"({q['io_ms']:.1f} -> {qp['io_ms']:.1f} ms/token); {qp['useful']:.1%} of routed experts were preloaded"
    )
    eb = acct[store]["expert_bytes"]
    print(
        f"expert-major prefill of {n} tokens read {rows[0]['prefill_mb']:.1f} MB of float16 experts; "
        f"token by token it would read {n * L * K * eb / 1e6:.1f} MB "
        f"(every expert once per layer and chunk: at most {L * E * eb / 1e6:.1f} MB)"
    )
    print(f"\npolicies and preloading at {SHARES[0]:.0%} of experts cached ({slots} slots), the Q store\n")
    print_rows(table, rows[0])
    best = max(table, key=lambda r: 1 / r["total_ms"])
    print(f"\nfastest: {best['label']} ({1e3 / best['total_ms']:.2f} tok/s, hit rate {best['hit']:.1%})")
    if a.runs > 1:
        print("\nms/token of each run: " + "; ".join(
            f"{r['label']}: {' / '.join('%.1f' % x for x in r['runs_ms'])}" for r in rows + table
        ))  # fmt: skip


# ---- speed on a synthetic store (replayed routing) ---------------------------------------------


def replayed_routes(path: str, n_layers: int, n_experts: int, k: int, tokens: int) -> np.ndarray:
    """[n_layers, tokens, k]: a MoE-fied model's routing, its experts merged in groups to n_experts,
    its layers reused cyclically, each token's first k distinct merged experts in its router's order."""
    src = np.load(path)
    L0, N0, K0 = src.shape
    E0 = int(src.max()) + 1
    group = max(1, E0 // n_experts)
    out = np.zeros((n_layers, min(tokens, N0), k), np.int16)
    for layer in range(n_layers):
        for t in range(out.shape[1]):
            seen = []
            for e in src[layer % L0, t]:
                m = min(int(e) // group, n_experts - 1)
                if m not in seen:
                    seen.append(m)
            for m in range(n_experts):  # too few distinct: fill in id order
                if len(seen) >= k:
                    break
                if m not in seen:
                    seen.append(m)
            out[layer, t] = seen[:k]
    return out


def replay_row(label, store, slots, preload, routes, predictor, ops, args) -> dict:

    lay = store.manifest.ffn
    L, N, K = routes.shape
    x = ops.array(np.random.default_rng(0).standard_normal((1, lay.d_model)).astype(np.float32) * 0.01)
    src = StreamedExperts(
        ops, store, ReaderPool(threads=4, mode="direct"), slots, "edgemoe", predictor if preload else None, preload
    )
    times, ios, mems = [], [], []
    try:
        for t in range(N):
            t0, io0, mem0 = time.perf_counter(), src.io_seconds, src.mem_seconds
            for layer in range(L):
                ids = routes[layer, t : t + 1].astype(np.int64)
                for wave, _ in src.waves(layer, ids):  # one call set per expert, each evaluated
                    for e in sorted(wave):
                        ops.to_numpy(llama.mlp(ops, args, wave[e], x))
            times.append((time.perf_counter() - t0) * 1e3)
            ios.append((src.io_seconds - io0) * 1e3)
            mems.append((src.mem_seconds - mem0) * 1e3)
        h, m = map(sum, zip(*src.hit_stats()))
        warm = times[1:] or times
        med = lambda xs: statistics.median(xs[1:] or xs)  # noqa: E731  the first token starts cold
        return {
            "label": label,
            "slots": slots,
            "total_ms": statistics.median(warm),
            "io_ms": med(ios),
            "mem_ms": med(mems),
            "compute_ms": med([a - b - c for a, b, c in zip(times, ios, mems)]),
            "mb": src.bytes_read / 1e6 / N,
            "hit": h / max(1, h + m),
            "useful": src.useful / max(1, src.routed_count),
        }
    finally:
        src.close()


def bench_synthetic(a) -> None:

    store = open_store(a.synthetic)
    lay, cfg = store.manifest.ffn, store.config
    if not lay.n_experts:
        raise FlashError(f"{a.synthetic}: not a synthetic MoE store (make it with --shape mixtral-8x7b)")
    if not a.routes or not os.path.isfile(a.routes):
        raise FlashError("--routes: give a routes-wikipedia.npy from tools/trace_experts.py to replay")
    L, E, K = len(lay.layer_offsets), lay.n_experts, cfg["num_experts_per_tok"]
    routes = replayed_routes(a.routes, L, E, K, 1024 + a.tokens)  # the predictor learns from the first 1024
    fit, run_routes = routes[:, :1024], routes[:, 1024:]
    int4_path = a.int4 or a.synthetic.rstrip("/") + "-int4"
    if not os.path.isdir(int4_path):
        print(f"writing {int4_path} (all experts INT4)")
        write_expert_store(store, int4_path, [[4] * E for _ in range(L)])
    int4 = open_store(int4_path)
    pred = fit_routing_predictor(fit, model_id(int4), E)
    ops = get_backend("torch")
    args = ModelArgs.from_dict(cfg)
    rows = [
        replay_row("IO-EXP (float16, no cache)", store, K, 0, run_routes, None, ops, args),
        replay_row("IO-QEXP = Q (INT4, no cache)", int4, K, 0, run_routes, None, ops, args),
        replay_row("Q+P", int4, 2 * K, K, run_routes, pred, ops, args),
    ]
    slot_bytes = int4.manifest.ffn.expert_nbytes + 4 * 3 * lay.expert_neurons * lay.d_model  # stored + float32
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for share in SHARES:
        slots = max(2 * K, int(share * L * E))
        if slots * slot_bytes > 0.7 * ram:
            print(
                f"skipping {share:.0%} cached: {slots} slots need {slots * slot_bytes / 1e9:.1f} GB "
                f"(stored and converted), more than 70% of this machine's {ram / 1e9:.1f} GB"
            )
            continue
        rows.append(
            replay_row(f"Q+P+C, {share:.0%} of experts cached (ours)", int4, slots, K, run_routes, pred, ops, args)
        )
    print(
        f"\nsynthetic {cfg['model_type']} store, {L} layers x {E} experts of {lay.expert_neurons} neurons, top-{K}; "
        f"random weights, routing replayed; experts only (no attention); ms per token over {L} layers\n"
    )
    print_rows(rows, rows[0])
