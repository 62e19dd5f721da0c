"""Engines inside a memory limit: this engine (each backend) and a peer (llama.cpp through
llama-cpp-python, mmap and no-mmap) take turns in a fresh memory cgroup at each limit, the page
cache dropped before every run; prefill and decode tokens/s, time to first token, peak cgroup
usage, the process's peak RSS, major faults, bytes read and OOM kills beside the disk-bound rate;
one table, JSON and a plot.

    python -m mlx_flash.bench memory [--model GGUF] [--limits 25%,50%,75%,100%,150%] [--backends mlx,torch]
                                     [--sparse 0.5,0.1] [--peer llama.cpp|none] [--tokens 16] [--prompt-tokens 32]
                                     [--runs 1] [--teacher-forced]
                                     [--json OUT] [--plot OUT.png]
    python -m mlx_flash.bench memory --no-limit [--backends mlx,torch] [--tokens 16] [--runs 3]
    python -m mlx_flash.bench memory --kept [--backends mlx,torch] [--model M]

Limits: a percentage is of the weights an engine reads (the GGUF for the peer, the converted store
for ours) plus that engine's floor; bytes ("2GB", "1.5GiB") are the same for every engine; both are
capped at 90% of the memory this process may use. Floor: what an engine's process holds besides the
weights (interpreter, libraries, KV cache, buffers), taken as its peak RSS running the default model
with no limit less that model's weights, measured once per engine/mode before the limited runs.

Disk bound: the drive's read bandwidth (the best of a few in-flight settings reading the model's
file at the start, page cache bypassed; bench/cgroup.read_bandwidth) over the bytes each token must read
at that limit, the weights that do not fit beside the floor, max(0, weights - (limit - floor)): the
decode rate no engine can pass when every weight is used every token. "-" where the weights fit.
For a sparse row the weights a token uses are the resident tensors and that share of the FFN, for a
MoE model the resident tensors and the routed experts' share (experts per token over experts): a
bound for a cache that always holds the right rows or experts (looser than a dense exact row's).
The "read GB/s" column is what a row's decode actually read per second, to set beside it.

--teacher-forced (MoE models): the prompt is the Wikipedia corpus's first tokens and each decode pass
is fed the text's next token in every engine (random weights decode one token over and over, which
routes the same experts every step); rows of ours add the expert cache's hit rate over the decode
and "disk rate": the byte ranges that run's decode read, read again by the reader pool in the same
batches after dropping the page cache, as tokens/s (no decode reading those bytes can be faster).

Our engine runs with memory_budget="auto" (inside the cgroup: its limit less 5%); its plan line is
kept for each row. Its exact rows (ffn="auto": resident, hybrid or streamed as the plan says) come
first; --sparse SHARES adds, per backend, the sparse operating points of a synthetic checkpoint:
ffn="sparse" with the statistical predictor (a labelled statistical activity model drawing that
share of the FFN's read units per token; the reads are real, the output is noise). The GGUF is
converted into a store first, outside any cgroup, and the peer reads
the GGUF itself. TTFT: from the start of the engine's load to the first token (imports excluded), as
an mmap load defers its reads to the prompt's pass; prefill tokens/s: the prompt's pass alone;
decode tokens/s: the forward passes after the first token (TOKENS - 1).

--kept: memory_budget against the peak RSS it allows, per backend, on the default model (or --model):
the number a refusal of a 1 MB budget names (what the process reaches before it can plan), the
minimum a refusal at that number names, and a one-shot chat answer (`python -m mlx_flash.chat
--prompt ... --max-tokens 32`) at the minimum and at twice it; each row's peak is the process's
VmHWM as its parent reads it (ru_maxrss), the refused rows' included. With root and a cgroup memory
controller each run also goes in a cgroup of the budget's size (OOM kills counted).

--no-limit: the memory of a user's first minutes, no cgroup: RSS after load + TOKENS tokens, peak RSS
and the heavy frameworks imported, per engine/mode, each in a fresh process (median of --runs).

Limits need root and a cgroup memory controller (refused in one line otherwise). The peer needs
`make peers`; without it the rows are ours alone and the output says why.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from mlx_flash.budget import parse_budget
from mlx_flash.config import default_cache_dir
from mlx_flash.default_model import default_model_path, resolve_store
from mlx_flash.errors import FlashError, exit_status, first_paragraph
from mlx_flash.memory import available_memory
from mlx_flash.bench.budget_kept import kept_rows
from mlx_flash.bench.memory_limits import Engine, engines_for, store_sizes, summarize
from mlx_flash.bench.cgroup import (
    MEMORY_CHILD,
    MemoryCgroup,
    drop_page_cache,
    own_memory_cgroup,
    read_bandwidth,
    replay_reads,
)
from mlx_flash.calibrate import read_corpus
from mlx_flash.tokenizer import Tokenizer

from mlx_flash.bench.models import NAMES, bench_model
from mlx_flash.bench.record import bench_provenance, write
from mlx_flash.bench.commands.memory_report import MB, fmt_cell, model_title, plot, print_table, replot
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError

PROMPT = "The quick brown fox jumps over the lazy dog. "
CAP_SHARE = 0.9  # of the memory this process may use: the rest is for the harness and the system


def prompt_ids(store: str, n: int) -> list[int]:
    ids = Tokenizer(store).encode(PROMPT * n)[:n]
    if len(ids) < n:
        raise FlashError(f"the prompt encodes to {len(ids)} tokens, fewer than --prompt-tokens {n}")
    return ids


def text_ids(store: str, prompt: int, fed: int) -> tuple[list[int], list[int]]:
    """Teacher forcing: the Wikipedia corpus's first `prompt` tokens, and the `fed` that follow."""
    ids = Tokenizer(store).encode(read_corpus("wikipedia")[:20000])
    if len(ids) < prompt + fed:
        raise FlashError(f"the Wikipedia text encodes to {len(ids)} tokens, fewer than {prompt} + {fed}")
    return ids[:prompt], ids[prompt : prompt + fed]


def command(e: Engine, tokens: int, ids: list[int], model: str | None = None, fed=None, read_log=None) -> list[str]:
    cmd = [sys.executable, MEMORY_CHILD, e.name, model or e.model, e.run_mode, str(tokens), ",".join(map(str, ids))]
    if fed:
        cmd += ["--fed", ",".join(map(str, fed))]
    if read_log:
        cmd += ["--read-log", read_log]
    return cmd


def last_json(stdout: str) -> dict | None:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def plan_line(stderr: str) -> str:
    return next((line for line in stderr.splitlines() if line.startswith("memory: limit")), "")


def unlimited(e: Engine, tokens: int, ids: list[int], model: str | None = None) -> dict:
    r = subprocess.run(command(e, tokens, ids, model), capture_output=True, text=True)
    out = last_json(r.stdout) if r.returncode == 0 else None
    if out is None:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise FlashError(f"the {e.label} run with no limit failed: {tail}")
    return out


def floors(engines: list[Engine], tokens: int, prompt_tokens: int) -> dict[str, int]:
    """Each engine/mode's floor (see the module docstring) from a run of the default model."""
    gguf = default_model_path()
    store = resolve_store(None, default_cache_dir(), "source", progress=True)
    ids = prompt_ids(store, prompt_tokens)
    out = {}
    for e in engines:
        if e.active is not None:  # a sparse row holds what its backend's exact row holds besides the weights
            out[e.label] = out[f"{e.name} {e.mode}"]
            continue
        small, weights = (gguf, os.path.getsize(gguf)) if e.name == "llama.cpp" else (store, store_sizes(store)[0])
        out[e.label] = max(0, unlimited(e, tokens, ids, small)["vmhwm"] - weights)
    return out


def resolve_limits(text: str, e: Engine, floor: int, cap: int) -> list[tuple[str, int]]:
    """(label, bytes) of each limit for engine e (see the module docstring)."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        n = parse_budget(item, e.weights) + floor if item.endswith("%") else parse_budget(item, 0)
        out.append((item if n <= cap else f"{item} capped", min(n, cap)))
    return out


def one_run(e: Engine, limit: int, tokens: int, ids: list[int], timeout: float, fed=None) -> dict:
    """One cold run in a fresh cgroup. A teacher-forced MoE run of ours also has the byte ranges its
    decode read, read again by the reader pool after dropping the page cache: `replay_tps`, the
    decode rate the drive allows for exactly those reads."""
    log = None
    if fed and e.name == "mlx_flash" and e.routed < 1:
        fd, log = tempfile.mkstemp(suffix=".json", prefix="bench_memory_reads_")
        os.close(fd)
    drop_page_cache()
    with MemoryCgroup(limit) as cg:
        r = cg.run(command(e, tokens, ids, fed=fed, read_log=log), timeout=timeout)
    out = (last_json(r.stdout) if r.returncode == 0 else None) or {}
    if log is not None:
        with open(log) as fh:
            text = fh.read()
        os.unlink(log)
        if text:
            reads = json.loads(text)
            seconds = replay_reads(reads["batches"], reads["threads"])
            out["replay_tps"] = (tokens - 1) / seconds if seconds else None
    if "ttft_s" in out:  # an mmap load reads nothing and the prompt's pass faults the weights in: count both
        out["first_token_s"] = out["load_s"] + out["ttft_s"]
    if r.oom_killed:
        outcome = "OOM-killed"
    elif r.timed_out:
        outcome = f"timed out ({timeout:.0f} s)"
    elif "refused" in out:
        outcome = "refused"
    elif r.returncode != 0 or not out:
        outcome = "failed: " + (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:120]
    else:
        outcome = "ok"
    return {
        **out,
        "outcome": outcome,
        "limit": limit,
        "peak_cgroup": r.peak,
        "refault_bytes": r.refault_bytes,
        "oom_kills": r.oom_kills,
        "major_faults_all": r.major_faults,
        "read_bytes_all": r.read_bytes,
        "wall_s": r.wall_s,
        "others_cpu": r.others_share,
        "plan_line": plan_line(r.stderr),
    }


def git_version() -> str:
    r = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=os.path.dirname(MEMORY_CHILD)
    )
    return r.stdout.strip() if r.returncode == 0 else ""


def limited(a) -> None:
    own_memory_cgroup()  # refuse before converting anything
    header = bench_provenance("memory", a.argv)  # the code measured: the checkout may change meanwhile
    version = git_version()
    asked = a.model or "default"
    model = bench_model(asked)
    gguf = model if model.endswith(".gguf") else None
    store = resolve_store(model, default_cache_dir(), "source", progress=True)
    engines, note = engines_for(gguf, store, a.backends, a.peer, a.sparse)
    if note:
        print(note, file=sys.stderr)
    if not engines:
        raise FlashError(f"nothing to run: no backends and no peer{' (' + note + ')' if note else ''}")
    ids, fed = (
        text_ids(store, a.prompt_tokens, a.tokens - 1)
        if a.teacher_forced
        else (prompt_ids(store, a.prompt_tokens), None)
    )
    floor = floors(engines, a.tokens, a.prompt_tokens)
    probe = gguf or max((os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs), key=os.path.getsize)
    bandwidth = read_bandwidth(probe)
    cap = int(available_memory().bytes * CAP_SHARE)
    print(
        f"model {model}\nstore {store}\nread bandwidth {bandwidth / 1e9:.2f} GB/s; limits capped at "
        f"{cap / MB:.0f} MB;"
        f" floors " + ", ".join(f"{k} {v / MB:.0f} MB" for k, v in floor.items()),
        file=sys.stderr,
    )
    limits = {e.label: resolve_limits(a.limits, e, floor[e.label], cap) for e in engines}
    rows = []
    for i in range(len(limits[engines[0].label])):
        runs = {e.label: [] for e in engines}
        for _ in range(a.runs):
            for e in engines:  # peer, ours, peer, ours: drift in the machine hits both alike
                label, limit = limits[e.label][i]
                r = one_run(e, limit, a.tokens, ids, a.timeout, fed)
                print(
                    f"  {e.label} at {limit / MB:.0f} MB: {r['outcome']}, decode "
                    f"{fmt_cell(r.get('decode_tps'), '.3f')} tok/s, {r['wall_s']:.0f} s, other processes used "
                    f"{r['others_cpu']:.0%} of the CPUs",
                    file=sys.stderr,
                )
                runs[e.label].append(r)
        rows += [summarize(e, *limits[e.label][i], floor[e.label], bandwidth, runs[e.label]) for e in engines]
    print_table(rows, bandwidth)
    if note:
        print(note)
    title = model_title(model)
    if a.json:
        write(
            a.json,
            header,
            **{
                "model": asked,
                "title": title,
                "store": store,
                "version": version,
                "tokens": a.tokens,
                "prompt_tokens": a.prompt_tokens,
                "bandwidth": bandwidth,
                "cap": cap,
                "floors": floor,
                "peer": note or "llama.cpp",
                "rows": rows,
            },
        )
    if a.plot:
        plot(rows, title, bandwidth, a.plot)


def no_limit(a) -> None:
    """The measurement this tool made before limits (RSS after load + tokens, peak, imports)."""
    model = bench_model(a.model or "default")
    store = resolve_store(model, default_cache_dir(), "source", progress=True)
    engines, note = engines_for(model if model.endswith(".gguf") else None, store, a.backends, a.peer)
    ids = prompt_ids(store, a.prompt_tokens)
    print(f"store: {store}\n{'engine/mode':26} {'RSS after (MB)':>15} {'peak RSS (MB)':>14}  imported")
    for e in engines:
        runs = [unlimited(e, a.tokens, ids) for _ in range(a.runs)]
        rss = statistics.median(r["rss_after"] for r in runs) / MB
        peak = statistics.median(r["vmhwm"] for r in runs) / MB
        print(f"{e.label:18} {rss:15.0f} {peak:14.0f}  {', '.join(runs[0]['imported']) or '-'}")
    if note:
        print(note)


def kept(a) -> None:
    try:
        own_memory_cgroup()
        cgroups = True
    except FlashError as e:
        cgroups = False
        print(f"no cgroups ({e}): peak RSS only", file=sys.stderr)
    rows = kept_rows(a.backends, a.model, cgroups)
    print("| budget | backend | run | peak RSS | peak / budget |" + (" OOM kills |" if cgroups else ""))
    print("|---|---|---|---|---|" + ("---|" if cgroups else ""))
    for r in rows:
        outcome = (
            f"answered ({r['tokens']} tokens)"
            if r["code"] == 0
            else "refused, naming it"
            if r["code"] == 2
            else f"exit {r['code']}"
        )
        peak = f"{r['peak'] / MB:.1f} MB" if r["peak"] else "-"
        share = f"{r['peak'] / r['budget']:.0%}" if r["peak"] else "-"
        print(
            f"| {r['budget'] / MB:.1f} MB | {r['backend']} | {r['what']}: {outcome} | {peak} | {share} |"
            + (f" {r['oom_kills']} |" if cgroups else "")
        )
    over = [r for r in rows if r["peak"] and r["peak"] > r["budget"]]
    for r in over:
        print(f"over the budget: {r['backend']} at {r['budget'] / MB:.1f} MB peaked at {r['peak'] / MB:.1f} MB")
    if a.json:
        write_json(
            a.json, {"version": git_version(), "model": a.model or "default", "rows": rows}, OutputError, indent=1
        )
    if over:
        raise FlashError(f"{len(over)} run(s) over their memory budget")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench memory", description=first_paragraph(__doc__))
    p.add_argument(
        "--model", default=None, help=f"{', '.join(NAMES)} or a GGUF (a store or HF dir: ours only; default: default)"
    )
    p.add_argument(
        "--limits",
        default="25%,50%,75%,100%,150%",
        help="memory limits: %% of an engine's weights plus its floor, or bytes (2GB); default 25%%..150%%",
    )
    p.add_argument(
        "--backends",
        "--configs",
        default="mlx,torch",
        help="our backends, each with its arithmetic after a slash (torch/q8), or none (default: mlx,torch)",
    )
    p.add_argument(
        "--sparse",
        default="",
        metavar="SHARES",
        help="also our sparse operating points on a synthetic checkpoint: shares of the FFN's read units "
        "a statistical activity model draws per token, e.g. 0.5,0.1 (labelled; default: none)",
    )
    p.add_argument("--peer", choices=["llama.cpp", "none"], default="llama.cpp", help="the peer engine")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per run (default: 16)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens (default: 32)")
    p.add_argument(
        "--teacher-forced",
        action="store_true",
        help="prompt and decode from the Wikipedia corpus, each pass fed the text's next token (MoE: routing "
        "follows real text); ours on a MoE model also reports its expert hit rate and the drive's rate for "
        "the ranges it read",
    )
    p.add_argument(
        "--runs", type=int, default=None, help="runs per engine and limit, medians (default 1; 3 with --no-limit)"
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default: 600)")
    p.add_argument("--json", default=None, metavar="OUT", help="write every row and run as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="tokens/s against the limit, a line per engine/mode")
    p.add_argument("--no-limit", action="store_true", help="RSS after load + tokens and peak RSS, no cgroup")
    p.add_argument(
        "--kept",
        action="store_true",
        help="peak RSS at the stated minimum memory budget and twice it, per backend (see above)",
    )
    p.add_argument("--from-json", default=None, metavar="IN", help="print the table (and --plot) of an earlier --json")
    a = p.parse_args(argv)
    a.argv = argv  # the command as typed, for the record
    a.backends = [] if a.backends == "none" else [b.strip() for b in a.backends.split(",") if b.strip()]
    a.runs = a.runs or (3 if a.no_limit else 1)
    try:
        a.sparse = tuple(float(s) for s in a.sparse.split(",") if s.strip())
    except ValueError:
        p.error(f"--sparse takes shares such as 0.5,0.1 (got {a.sparse!r})")
    if any(not 0 < s < 1 for s in a.sparse):
        p.error(f"--sparse shares must be in (0, 1) (got {a.sparse})")
    if a.tokens < 2:
        p.error("--tokens must be at least 2 (the first comes from the prompt's pass)")
    if a.from_json:
        return exit_status(lambda: replot(a.from_json, a.plot))
    if a.kept:
        return exit_status(lambda: kept(a))
    return exit_status(lambda: no_limit(a) if a.no_limit else limited(a))
