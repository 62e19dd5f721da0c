"""Continuous batching under load: `python -m mlx_flash.serve` as a subprocess, driven by 1, 4, 16
... concurrent streaming chat clients (each its own prompt, greedy); total generated tokens/s across
clients and its speedup over one client, median and max time to first token, streams checked
against each prompt's text when sent alone, and the server's peak RSS against its memory limit.
One table, JSON and a plot.

    python -m mlx_flash.bench concurrency [--model NAME|M] [--backend torch|mlx] [--clients 1,4,16]
        [--memory-budget 1.5GB] [--max-tokens 64] [--context-chars 0] [--max-batch 32] [--kv-budget B] [--repeat 1]
        [--server-arg='--threads 1' ...] [--dir DIR] [--json OUT] [--plot OUT.png]

Each run gets a fresh server (its own service directory under a temporary directory) on a free
loopback port: first a reference server that answers every prompt alone, one after another (the
text each prompt gets when nothing runs beside it); then, per client count C, a server where C
clients start together (a barrier) and each streams one request (stream=true, temperature 0,
stream_options.include_usage). Every server is warmed up first by requests of other prompts (one
alone, then C at once), so the first pass of the weights and the batched graphs are not timed.

Total tokens/s: the completion tokens of the final usage chunks of all C streams over the wall time
from the barrier to the last stream's end. TTFT: a client's request sent to its first content
chunk. Identity: each stream's text against the reference text of the same prompt; exact equality
is expected (greedy), a batched pass may rarely flip a near-tie token by float rounding; the first
differing chunk (= token) and character are reported. Memory: /v1/stats after the run (memory.peak,
the server process's peak RSS, against memory.limit). --repeat N: N fresh servers per client count;
the table shows the run of median tokens/s, and the best run with its ratio to 1 client's best. The
server's CPU seconds over each run and the machine's load average are kept: other processes on the
same cores slow every figure. --model: a name of mlx_flash/bench/models.py (default, gemma, ...),
else the server's --model. --json writes a record (mlx_flash/bench/record.py: commit, CPU, versions,
command, load before and after) with the parts config, reference, reference_median_tokens_per_s and
rows; result_tables_service.concurrency renders it as a table. The server subprocess and the
streaming clients are mlx_flash/bench/load_client.py (the standard library's http.client; no openai
package needed).
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile

from mlx_flash.calibrate import read_corpus
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.bench.load_client import Server, concurrent, stream_chat, warm
from mlx_flash.bench.models import NAMES, bench_model
from mlx_flash.bench.record import bench_provenance, write

PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of the seasons on Earth?",
    "Describe the water cycle to a ten-year-old.",
    "Give me three tips for learning to play the guitar.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "Write a poem about autumn leaves falling in a quiet park.",
    "What is the difference between weather and climate?",
    "Explain what a black hole is.",
    "Describe a typical day in the life of a medieval farmer.",
    "How does a bicycle stay upright when it is moving?",
    "List some healthy breakfast ideas and explain why they are good.",
    "What makes a good friend?",
    "Explain how bees make honey.",
    "Tell me about the history of the printing press.",
    "How do airplanes fly?",
    "Why do cats purr?",
    "What should I pack for a week of camping in the mountains?",
]


def prompt(i: int, context_chars: int = 0) -> str:
    """Client i's question; with context_chars, after its own excerpt of that many characters of the
    Wikipedia set (client i's starts i excerpts in), as a conversation that brings a long text."""
    q = PROMPTS[i] if i < len(PROMPTS) else f"{PROMPTS[i % len(PROMPTS)]} (Question {i + 1}.)"
    if not context_chars:
        return q
    text = read_corpus("wikipedia")[i * context_chars : (i + 1) * context_chars]
    return f"{text}\n\nSet the text above aside. {q}"


def compare(text: str, ref: str, deltas: list, ref_deltas: list) -> dict:
    if text == ref:
        return {"identical": True}
    char = next((k for k, (a, b) in enumerate(zip(text, ref)) if a != b), min(len(text), len(ref)))
    tok = next((k for k, (a, b) in enumerate(zip(deltas, ref_deltas)) if a != b), min(len(deltas), len(ref_deltas)))
    return {
        "identical": False,
        "first_diff_char": char,
        "first_diff_token": tok,
        "got": text[max(0, char - 20) : char + 40],
        "expected": ref[max(0, char - 20) : char + 40],
    }


# ---- the benchmark ---------------------------------------------------------------------------------
def server_flags(args, clients: int) -> list:
    """The server's flags for a run of `clients` clients (its queue holds them all)."""
    flags = [
        "--backend",
        args.backend,
        "--memory-budget",
        args.memory_budget,
        "--max-batch",
        str(args.max_batch),
        "--queue-limit",
        str(max(16, clients + 1)),
    ]
    if args.model:
        flags += ["--model", args.model_path]
    if args.kv_budget:
        flags += ["--kv-budget", args.kv_budget]
    for arg in args.server_arg:
        flags += arg.split()
    return flags


def references(args, base: str, n: int) -> list:
    with Server(os.path.join(base, "reference"), server_flags(args, 1), args.start_timeout) as srv:
        warm(srv.port, 1)
        refs = []
        for i in range(n):
            r = stream_chat(srv.port, prompt(i, args.context_chars), args.max_tokens)
            if r["error"]:
                raise RuntimeError(f"reference prompt {i}: {r['error']}\n{srv.log_text()[-2000:]}")
            refs.append(r)
            print(
                f"  reference {i:2d}: {r['tokens']:3d} tokens in {r['end'] - r['start']:.2f} s, "
                f"TTFT {r['ttft_s'] * 1e3:.0f} ms: {r['text'][:60]!r}",
                flush=True,
            )
    return refs


def run(args, base: str, clients: int, refs: list) -> dict:
    with Server(os.path.join(base, f"c{clients}"), server_flags(args, clients), args.start_timeout) as srv:
        warm(srv.port, clients)
        cpu0, load0 = srv.cpu_s(), load_average()
        results, t0 = concurrent(srv.port, [prompt(i, args.context_chars) for i in range(clients)], args.max_tokens)
        cpu1, load1 = srv.cpu_s(), load_average()
        stats = srv.stats()
        errors = [f"client {i}: {r['error']}" for i, r in enumerate(results) if r["error"]]
        wall = max(r["end"] for r in results) - t0
        tokens = sum(r["tokens"] for r in results)
        ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
        checks = [
            compare(r["text"], refs[i]["text"], r["deltas"], refs[i]["deltas"]) | {"client": i}
            for i, r in enumerate(results)
        ]
        mem = stats["memory"]
        row = {
            "clients": clients,
            "tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else 0.0,
            "ttft_median_ms": statistics.median(ttft) * 1e3 if ttft else None,
            "ttft_max_ms": max(ttft) * 1e3 if ttft else None,
            "server_cpu_s": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
            "load_average": [load0, load1],
            "per_client_tokens_per_s": statistics.median(r["tokens"] / (r["end"] - r["start"]) for r in results),
            "prompt_tokens_median": statistics.median((r["usage"] or {}).get("prompt_tokens", 0) for r in results),
            "identical": sum(c["identical"] for c in checks),
            "streams": clients,
            "mismatches": [c for c in checks if not c["identical"]],
            "errors": errors,
            "peak_rss": mem.get("peak"),
            "limit": mem.get("limit"),
            "held_rss": mem.get("held"),
            "stats": stats,
            "streams_detail": [
                {
                    "client": i,
                    "prompt": r["prompt"],
                    "tokens": r["tokens"],
                    "ttft_s": r["ttft_s"],
                    "seconds": r["end"] - r["start"],
                    "finish_reason": r["finish_reason"],
                    "text": r.get("text", ""),
                }
                for i, r in enumerate(results)
            ],
        }
        if errors:
            print("  " + "\n  ".join(errors[:5]), file=sys.stderr)
    return row


def load_average():
    """The machine's 1-minute load average (other processes compete for the same cores), None where unknown."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def median_row(runs: list) -> dict:
    """The run of median total tokens/s among repeats (each a fresh server), with every repeat's figures."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["repeats"] = [
        {
            k: r[k]
            for k in (
                "tokens_per_s",
                "wall_s",
                "ttft_median_ms",
                "ttft_max_ms",
                "server_cpu_s",
                "load_average",
                "identical",
                "per_client_tokens_per_s",
            )
        }
        for r in runs
    ]
    row["best_tokens_per_s"] = ranked[-1]["tokens_per_s"]
    row["mismatches"] = [m | {"repeat": k} for k, r in enumerate(runs) for m in r["mismatches"]]
    row["errors"] = [f"repeat {k}, {e}" for k, r in enumerate(runs) for e in r["errors"]]
    row["peak_rss"] = max((r["peak_rss"] for r in runs if r["peak_rss"] is not None), default=None)
    return row


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["clients"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [r["tokens_per_s"] for r in rows], "o-", label="measured")
    base = rows[0]["tokens_per_s"] / rows[0]["clients"] if rows and rows[0]["clients"] else 0
    a.plot(xs, [base * x for x in xs], "--", color="gray", label="linear in clients")
    a.set_xlabel("concurrent streaming clients")
    a.set_ylabel("total generated tokens/s")
    a.set_xscale("log", base=2)
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    b.plot(xs, [r["ttft_median_ms"] for r in rows], "o-", label="median")
    b.plot(xs, [r["ttft_max_ms"] for r in rows], "s--", label="max")
    b.set_xlabel("concurrent streaming clients")
    b.set_ylabel("time to first token (ms)")
    b.set_xscale("log", base=2)
    b.grid(alpha=0.3)
    for ax in (a, b):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def fmt_ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def fmt_mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.0f} MB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench concurrency", description=first_paragraph(__doc__))
    p.add_argument(
        "--model",
        default=None,
        help=f"{', '.join(NAMES)} or the server's --model (default: the server's default model)",
    )
    p.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    p.add_argument("--clients", default="1,4,16", help="client counts, comma-separated (default: 1,4,16)")
    p.add_argument("--memory-budget", default="1.5GB", help="the server's --memory-budget (default: 1.5GB)")
    p.add_argument("--kv-budget", default=None, help="the server's --kv-budget (default: the server's)")
    p.add_argument("--max-batch", type=int, default=32, help="the server's --max-batch (default: 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default: 64)")
    p.add_argument(
        "--context-chars",
        type=int,
        default=0,
        help="put an excerpt of this many characters of the Wikipedia set before each question "
        "(2300: about 512 tokens); default: the question alone",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="more flags for the server, e.g. --server-arg='--threads 1' (repeatable)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per client count, each on a fresh server; the table shows the median (default: 1)",
    )
    p.add_argument("--start-timeout", type=float, default=300, help="seconds a server may take to come up")
    p.add_argument("--dir", default=None, help="keep the servers' directories (logs, contexts) here")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    try:
        counts = [int(c) for c in a.clients.split(",")]
        if not counts or min(counts) < 1:
            raise ValueError
    except ValueError:
        print("error: --clients takes positive integers, comma-separated (1,4,16)", file=sys.stderr)
        return 1
    header = bench_provenance("concurrency", argv)
    try:
        a.model_path = bench_model(a.model) if a.model else None
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    base = a.dir or tempfile.mkdtemp(prefix="bench-concurrency-")
    rows = []
    try:
        print(f"references: {max(counts)} prompts alone, one after another", flush=True)
        refs = references(a, base, max(counts))
        runs = {c: [] for c in counts}
        for k in range(a.repeat):  # repeats outermost: a slow spell of the machine hits every count alike
            for c in counts:
                row = run(a, os.path.join(base, f"r{k}"), c, refs)
                runs[c].append(row)
                cpu = "-" if row["server_cpu_s"] is None else f"{row['server_cpu_s']:.1f}"
                print(
                    f"{c:3d} clients{f' (repeat {k + 1})' if a.repeat > 1 else ''}: {row['tokens']} tokens in "
                    f"{row['wall_s']:.2f} s: {row['tokens_per_s']:.1f} tok/s, TTFT median "
                    f"{fmt_ms(row['ttft_median_ms'])} ms max {fmt_ms(row['ttft_max_ms'])} ms, {row['identical']}/{c} "
                    f"identical, server CPU {cpu} s, load {row['load_average'][0]:.1f}, "
                    f"prompt tokens {row['prompt_tokens_median']:.0f} (median)",
                    flush=True,
                )
        rows = [median_row(runs[c]) for c in counts]
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    one = next((r["tokens_per_s"] for r in rows if r["clients"] == 1), None)
    one_best = next((r["best_tokens_per_s"] for r in rows if r["clients"] == 1), None)
    solo = statistics.median(r["tokens"] / (r["end"] - r["start"]) for r in refs)
    extra = f" {' '.join(a.server_arg)}" if a.server_arg else ""
    print(
        f"\n{a.backend}, --memory-budget {a.memory_budget}{extra}, max_tokens {a.max_tokens}, greedy, {a.repeat} "
        f"repeat(s); reference: each prompt alone, median {solo:.1f} tok/s"
    )
    print(
        "| clients | tokens | wall s | total tok/s | x vs 1 client | best tok/s | best x | per-stream tok/s | "
        "TTFT median ms | TTFT max ms | server CPU ms/token | identical | peak RSS / limit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / one if one else None
        r["best_speedup"] = r["best_tokens_per_s"] / one_best if one_best else None
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        bsp = f"{r['best_speedup']:.2f}x" if r["best_speedup"] else "-"
        cpu = "-" if r["server_cpu_s"] is None or not r["tokens"] else f"{r['server_cpu_s'] / r['tokens'] * 1e3:.1f}"
        same = sum(x["identical"] for x in r["repeats"])
        print(
            f"| {r['clients']} | {r['tokens']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.1f} | {sp} | "
            f"{r['best_tokens_per_s']:.1f} | {bsp} | {r['per_client_tokens_per_s']:.1f} | "
            f"{fmt_ms(r['ttft_median_ms'])} | {fmt_ms(r['ttft_max_ms'])} | {cpu} | "
            f"{same}/{r['streams'] * len(r['repeats'])} | {fmt_mb(r['peak_rss'])} / {fmt_mb(r['limit'])} |"
        )
    same = sum(x["identical"] for r in rows for x in r["repeats"])
    total = sum(r["streams"] * len(r["repeats"]) for r in rows)
    print(f"\nstreams identical to their prompt alone: {same} of {total}")
    for r in rows:
        for m in r["mismatches"]:
            print(
                f"{r['clients']} clients, repeat {m['repeat'] + 1}, client {m['client']}: differs from its prompt "
                f"alone at token {m['first_diff_token']} (char {m['first_diff_char']}): {m['got']!r} vs "
                f"{m['expected']!r}"
            )
        if r["errors"]:
            print(f"{r['clients']} clients: {len(r['errors'])} errors: {r['errors'][0]}")
        if r["peak_rss"] and r["limit"] and r["peak_rss"] > r["limit"]:
            print(f"{r['clients']} clients: peak RSS {fmt_mb(r['peak_rss'])} is over the limit {fmt_mb(r['limit'])}")
    if a.json:
        write(
            a.json,
            header,
            config={k: v for k, v in vars(a).items() if k not in ("json", "plot", "model_path")},
            reference=[
                {
                    "prompt": r["prompt"],
                    "tokens": r["tokens"],
                    "ttft_s": r["ttft_s"],
                    "seconds": r["end"] - r["start"],
                    "text": r["text"],
                }
                for r in refs
            ],
            reference_median_tokens_per_s=solo,
            rows=rows,
        )
    if a.plot and rows:
        plot(rows, a.plot)
    return 1 if any(r["errors"] for r in rows) else 0
