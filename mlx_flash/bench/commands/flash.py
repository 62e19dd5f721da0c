"""LLM in a flash on a dense model: per-token breakdown for each mode under one memory budget
(the paper's Tables 2 and 3), measured with cold reads (direct I/O), next to the cost model.

    python -m mlx_flash.bench flash [--model PATH] [--precision auto] [--budget 50%]
                                    [--modes naive,hybrid,predictor,window,all] [--tokens 32]
                                    [--window 0] [--predictor lowrank|gate|dense|statistical] [--recall R]
                                    [--backend auto|mlx|torch] [--speculative N]
                                    [--synthetic STORE --active 0.03] [--cgroup-limit BYTES] [--json OUT]

Columns are medians over the generated tokens: I/O ms (blocked on reads), mem ms (neuron-cache
bookkeeping and turning rows into weights), compute ms (the rest), total ms, MB read, reads, mean
read size, rows loaded per token (share of all FFN rows), and the cost model's I/O prediction
from the same token's reads (bytes, count) through the disk profile.
"""

import argparse
import os
import resource
import statistics

import mlx_flash
from mlx_flash.calibrate import corpus_path
from mlx_flash.errors import FlashError, exit_status, first_paragraph
from mlx_flash.sparse import cost_model
from mlx_flash.store.disk_profile import default_profile
from mlx_flash.budget import parse_budget
from mlx_flash.calibrate import StatisticalActivity
from mlx_flash.calibrate import replay
from mlx_flash.config import default_cache_dir
from mlx_flash.sparse.build import replay_source
from mlx_flash.sparse.modes import SparseMode
from mlx_flash.sparse.planner import plan_budget
from mlx_flash.store import open_store
from mlx_flash.store.sizes import model_bytes
from mlx_flash.store.stream_pool import stream_pool
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError


def bench_mode(a, mode, prompt, profile):
    flash = mlx_flash.FlashOptions(
        mode=mode,
        window=a.window,
        predictor=a.predictor,
        recall=a.recall,
        statistical_active=a.active,
        down_only=a.down_only and mode in ("predictor", "window", "all"),
    )
    eng = mlx_flash.load(
        a.model,
        backend=a.backend,
        precision=a.precision,
        ffn="sparse",
        weights_budget=None if a.budget == "auto" else a.budget,
        flash=flash,
        io=mlx_flash.IOOptions(mode="direct"),
        progress=False,
    )
    with eng:
        src = eng.ffn
        text = eng.generate(prompt, max_tokens=a.tokens + 1)
        steps = eng.last.steps[1:]  # the first token comes from the prompt pass, with no decode step
        lay = src.layout
        L, F = len(lay.layer_offsets), lay.n_neurons
        med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
        pred = [cost_model.io_seconds(profile, s.bytes_read, s.reads, L, src.pool.threads) * 1e3 for s in steps]
        row = {
            "mode": mode,
            "io_ms": med([s.io_ms for s in steps]),
            "mem_ms": med([s.mem_ms for s in steps]),
            "compute_ms": med([s.compute_ms for s in steps]),
            "total_ms": med([s.wall_ms for s in steps]),
            "mb_read": med([s.bytes_read / 1e6 for s in steps]),
            "reads": med([s.reads for s in steps]),
            "predicted_io_ms": med(pred),
            "rows_loaded_share": src.rows_loaded / max(1, src.decode_layer_steps * F),
            "rows_active_share": src.rows_active / max(1, src.decode_layer_steps * F),
            "cached_rows_per_layer": src.cached_rows(),
            "plan": mlx_flash.memory_plan(eng),
            "text": text[:60],
            "window": src.plan.window,
            "ffn_side_bytes": src.resident_bytes(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        row["mean_read_kb"] = row["mb_read"] * 1e3 / row["reads"] if row["reads"] else 0.0
        row["tok_s"] = 1e3 / row["total_ms"] if row["total_ms"] else 0.0
        row["decode_tok_s"] = eng.last.decode_tps
        if a.speculative:
            s0 = src.stats()
            same = eng.generate(prompt, max_tokens=a.tokens + 1, speculative=a.speculative) == text
            s = eng.last
            row["speculative"] = {
                "draft": a.speculative,
                "decode_tok_s": s.decode_tps,
                "same_text": same,
                "accepted": s.draft_accepted,
                "proposed": s.draft_proposed,
                "mb_read_per_token": (src.stats().bytes_read - s0.bytes_read) / 1e6 / max(1, s.generated_tokens),
                "io_ms_per_token": (src.stats().io_seconds - s0.io_seconds) * 1e3 / max(1, s.generated_tokens),
            }
        return row


def bench_synthetic(a, mode, profile):
    """I/O-only replay on a synthetic store (random weights, statistical activity: synthetic)."""

    store = open_store(a.synthetic)
    lay = store.manifest.ffn
    plan, account = plan_budget(SparseMode(mode), parse_budget(a.budget, model_bytes(store)), store, 0, a.window or 4)
    activity = StatisticalActivity(len(lay.layer_offsets), lay.n_neurons, a.active, seed=0)
    chunk = lay.layer_nbytes if mode in ("naive", "hybrid") else lay.bundle_bytes
    src = replay_source(store, stream_pool(default_cache_dir(), chunk), plan, progress=True)
    try:
        tokens = a.naive_tokens if mode in ("naive", "hybrid") else a.tokens
        steps = replay(src, activity, tokens + 1, profile, progress=True)[1:]  # the first fills the caches
        med = lambda k: statistics.median(s[k] for s in steps)  # noqa: E731
        L, F = len(lay.layer_offsets), lay.n_neurons
        return {
            "mode": mode,
            "io_ms": med("io_ms"),
            "mem_ms": med("mem_ms"),
            "compute_ms": 0.0,
            "total_ms": med("wall_ms"),
            "mb_read": med("bytes") / 1e6,
            "reads": med("reads"),
            "predicted_io_ms": med("model_io_ms"),
            "rows_loaded_share": med("rows_loaded") / (L * F),
            "tok_s": 1e3 / med("wall_ms"),
            "plan": account,
            "ffn_side_bytes": src.resident_bytes(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "mean_read_kb": med("bytes") / 1e3 / max(1, med("reads")),
            "synthetic": True,
            "steps": steps,
        }
    finally:
        src.close()


CGROUP_ROOT = "/sys/fs/cgroup/memory"


def enter_cgroup(limit) -> str:
    """Move this process into a fresh cgroup-v1 memory cgroup capped at `limit` bytes."""

    path = os.path.join(CGROUP_ROOT, f"mlx_flash_bench_{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as fh:  # (cgroup controls, not data)
            fh.write(str(parse_budget(limit, 0)))
        with open(os.path.join(path, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
    except OSError as e:
        raise FlashError(f"{path}: cannot create a memory cgroup ({e.strerror}); needs root and cgroup v1") from None
    return path


def cgroup_usage(path: str) -> dict:
    def read(name):
        with open(os.path.join(path, name)) as fh:
            return fh.read()

    stat = dict(line.split() for line in read("memory.stat").splitlines())
    return {
        "limit": int(read("memory.limit_in_bytes")),
        "max_usage": int(read("memory.max_usage_in_bytes")),
        "cache": int(stat["cache"]),
        "rss": int(stat["rss"]),
        "failcnt": int(read("memory.failcnt")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench flash", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None)
    p.add_argument(
        "--precision",
        default="auto",
        help="store precision for every mode (default auto: what load() picks for --predictor, so "
        "naive and the predictor modes read the same store)",
    )
    p.add_argument(
        "--budget",
        default="50%",
        help="weights budget (a share of the model, bytes, or auto: what the memory limit leaves)",
    )
    p.add_argument("--modes", default="naive,hybrid,predictor,window,all")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--window", type=int, default=0, help="0 (default): the planner picks (with --synthetic: 4)")
    p.add_argument(
        "--predictor",
        default="lowrank",
        choices=("lowrank", "gate", "dense", "statistical"),
        help="statistical: a labelled statistical activity model drawing --active of the read units "
        "per token (synthetic checkpoints: their output is noise, their reads are real)",
    )
    p.add_argument("--backend", default="torch", choices=("auto", "mlx", "torch"))
    p.add_argument(
        "--down-only",
        action="store_true",
        help="with --predictor gate: read only down columns; gate/up come from its 4-bit copy",
    )
    p.add_argument("--recall", type=float, default=None, help="predictor cut calibrated for this recall")
    p.add_argument("--speculative", type=int, default=0, help="also decode with prompt-lookup drafts of N tokens")
    p.add_argument(
        "--synthetic",
        default=None,
        metavar="STORE",
        help="I/O-only replay on a synthetic store (tools/make_synthetic.py), activity from a "
        "statistical model; no compute",
    )
    p.add_argument(
        "--active", type=float, default=0.03, help="with --synthetic or --predictor statistical: active share per token"
    )
    p.add_argument("--naive-tokens", type=int, default=3, help="with --synthetic: tokens for naive/hybrid")
    p.add_argument(
        "--cgroup-limit",
        default=None,
        metavar="BYTES",
        help="run inside a new cgroup-v1 memory cgroup with this limit (root; e.g. 2.5GB) and report "
        "its peak usage and page-cache share",
    )
    p.add_argument("--json", default="bench_results/flash.json")
    return exit_status(lambda: run(p.parse_args(argv)))


def run(a) -> None:
    cgroup = enter_cgroup(a.cgroup_limit) if a.cgroup_limit else None
    # one store for every mode: auto resolved for the predictor, not per mode
    a.precision = mlx_flash.EngineConfig(
        ffn="sparse", precision=a.precision, flash=mlx_flash.FlashOptions(predictor=a.predictor)
    ).store_precision()
    print(f"store precision {a.precision}")
    with open(corpus_path("wikipedia"), encoding="utf-8") as fh:
        prompt = fh.read()[:400]
    profile = default_profile(mlx_flash.config.default_cache_dir())
    rows = []
    hdr = (
        f"{'mode':<10} {'I/O ms':>7} {'mem ms':>7} {'comp ms':>8} {'total ms':>9} {'MB read':>8} {'reads':>6} "
        f"{'KB/read':>8} {'rows %':>7} {'tok/s':>6} {'model I/O':>9}"
    )
    if a.synthetic:
        print(
            f"SYNTHETIC: {a.synthetic}, random weights, statistical activity {a.active:.1%} per token, "
            f"I/O only (compute ms not measured)"
        )
    print(hdr)
    for mode in a.modes.split(","):
        r = bench_synthetic(a, mode, profile) if a.synthetic else bench_mode(a, mode, prompt, profile)
        rows.append(r)
        print(
            f"{mode:<10} {r['io_ms']:>7.1f} {r['mem_ms']:>7.1f} {r['compute_ms']:>8.1f} {r['total_ms']:>9.1f} "
            f"{r['mb_read']:>8.2f} {r['reads']:>6.0f} {r['mean_read_kb']:>8.1f} "
            f"{100 * r['rows_loaded_share']:>6.1f}% {r['tok_s']:>6.1f} {r['predicted_io_ms']:>9.1f}",
            flush=True,
        )
        if not a.synthetic and mode in ("window", "all"):
            print(
                f"{'':<10} window {r['window']} (" + ("planner" if not a.window else "--window") + "), "
                f"{r['plan']['ffn_rows_per_layer']} cached rows per layer",
                flush=True,
            )
        if a.synthetic or mode == a.modes.split(",")[-1]:
            print(
                f"{'':<10} accounted FFN-side memory {r['ffn_side_bytes'] / 1e6:.0f} MB, peak RSS "
                f"{r['peak_rss_mb']:.0f} MB, planned total {r['plan']['planned_total'] / 1e9:.2f} GB "
                f"of budget {r['plan']['budget'] / 1e9:.2f} GB",
                flush=True,
            )
        if "speculative" in r:
            sp = r["speculative"]
            print(
                f"{'':<10} speculative x{sp['draft']}: {sp['decode_tok_s']:.1f} tok/s (plain {r['decode_tok_s']:.1f}), "
                f"{sp['accepted']}/{sp['proposed']} drafts kept, {sp['mb_read_per_token']:.1f} MB and "
                f"{sp['io_ms_per_token']:.1f} ms I/O per token, same text: {sp['same_text']}",
                flush=True,
            )
    if cgroup:
        usage = cgroup_usage(cgroup)
        rows.append({"cgroup": usage})
        print(
            f"cgroup limit {usage['limit'] / 1e9:.2f} GB: peak usage {usage['max_usage'] / 1e9:.2f} GB, "
            f"page cache now {usage['cache'] / 1e6:.0f} MB, anonymous {usage['rss'] / 1e6:.0f} MB, "
            f"limit hit {usage['failcnt']} times"
        )
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        write_json(a.json, rows, OutputError, indent=1)
