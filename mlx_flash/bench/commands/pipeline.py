"""A model split across ranks, each inside its own memory limit, against one process inside one such
limit: decode tokens/s of the chat (`python -m mlx_flash.chat --pipeline --prompt ... --verbose`),
each rank in a fresh memory cgroup of --limit, the page cache dropped before each run; the layer
ranges and every rank's memory plan line printed. With --batch N: the throughput mode instead
(`python -m mlx_flash.batch`, N prompts of --tokens tokens each), micro-batches flowing through the
ranks against one process given the same total memory (--ranks times --limit), tokens/s of the
whole run, prefill included. With --gguf FILE (not with --batch), llama.cpp decodes the same file
and prompt in one cgroup of --limit beside them.

    python -m mlx_flash.bench pipeline [--model STORE_OR_GGUF] [--ranks 2] [--limit 2GB] [--tokens 8]
                                       [--backend mlx] [--launcher ring|gloo] [--batch N] [--gguf FILE]
                                       [--engine-args "FLAGS"] [--json OUT]

The ranks run on this machine over loopback (distributed.local gives them the environment
mlx.launch or torchrun would); they share its cores and its drive, so the ratio measures what
splitting the memory buys, not what more machines add. Root and a cgroup memory controller needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
import threading

from mlx_flash.budget import parse_budget
from mlx_flash.distributed.local import rank_envs
from mlx_flash.errors import exit_status, first_paragraph
from mlx_flash.bench.cgroup import MEMORY_CHILD, MemoryCgroup, drop_page_cache
from mlx_flash.units import fmt
from mlx_flash.default_model import resolve_store
from mlx_flash.tokenizer import Tokenizer
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError

PROMPT = "Write the opening of a story about a lighthouse keeper and a storm."
TOPICS = [
    "a lighthouse keeper",
    "the first snow",
    "a lost map",
    "an old clock",
    "a river town",
    "a night train",
    "a garden in spring",
    "a chess match",
    "a mountain pass",
    "a bakery at dawn",
    "a quiet library",
    "a storm at sea",
    "a market day",
    "a forgotten song",
    "a desert well",
    "a city bridge",
]
DECODE = re.compile(r"generated (\d+) tok at ([0-9.]+) tok/s")
THROUGHPUT = re.compile(r"(?:measured [0-9.]+ s|in [0-9.]+ s) \(([0-9.]+) tok/s\)")


def chat_cmd(a, pipeline: bool) -> list[str]:
    if a.batch:
        cmd = [
            sys.executable,
            "-m",
            "mlx_flash.batch",
            a.prompts,
            a.outputs[pipeline],
            "--max-tokens",
            str(a.tokens),
            "--backend",
            a.backend,
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "mlx_flash.chat",
            "--prompt",
            PROMPT,
            "--max-tokens",
            str(a.tokens),
            "--verbose",
            "--backend",
            a.backend,
        ]
    if a.model:
        cmd += ["--model", a.model]
    cmd += shlex.split(a.engine_args)
    return cmd + (["--pipeline", "--pipeline-timeout", "600"] if pipeline else [])


def write_prompts(path: str, n: int) -> None:
    with open(path, "w") as fh:  # (not durable: one run's prompts, in its temporary folder)
        for k in range(n):
            topic = TOPICS[k % len(TOPICS)]
            message = {"role": "user", "content": f"Write a short story about {topic}."}
            fh.write(json.dumps({"id": k, "messages": [message]}) + "\n")


def decode_rate(stderr: str, batch: bool) -> float | None:
    """The chat's decode rate, or the throughput mode's tokens/s of the whole run."""
    found = (THROUGHPUT if batch else DECODE).findall(stderr)
    if not found:
        return None
    return float(found[-1] if batch else found[-1][1])


def plan_lines(stderr: str) -> list[str]:
    lines = stderr.replace("\r", "\n").splitlines()  # (progress bars end their lines with \r)
    return [line for line in lines if line.startswith(("memory:", "pipeline", "policy", "per token:"))]


def one_process(a, limit: int) -> dict:
    drop_page_cache()
    with MemoryCgroup(limit) as cg:
        r = cg.run(chat_cmd(a, False), timeout=3600)
    return {
        "config": "one process",
        "tok_s": decode_rate(r.stderr, bool(a.batch)),
        "peaks": [r.peak],
        "oom_kills": r.oom_kills,
        "plans": plan_lines(r.stderr),
        "returncodes": [r.returncode],
        "tail": r.stderr[-400:],
        "answer": r.stdout,
    }


def pipeline(a, limit: int) -> dict:
    drop_page_cache()
    runs = [None] * a.ranks
    with tempfile.TemporaryDirectory() as tmp:
        envs = rank_envs(a.ranks, tmp, a.launcher)
        groups = [MemoryCgroup(limit, name=f"mlx_flash_rank{r}") for r in range(a.ranks)]
        try:

            def run(r):
                runs[r] = groups[r].run(chat_cmd(a, True), timeout=3600, env={**os.environ, **envs[r]})

            threads = [threading.Thread(target=run, args=(r,)) for r in range(a.ranks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for g in groups:
                g.close()
    return {
        "config": f"{a.ranks} ranks ({a.launcher})",
        "tok_s": decode_rate(runs[0].stderr, bool(a.batch)),
        "peaks": [r.peak for r in runs],
        "oom_kills": sum(r.oom_kills for r in runs),
        "plans": [line for r in runs for line in plan_lines(r.stderr)],
        "returncodes": [r.returncode for r in runs],
        "tail": runs[0].stderr[-400:],
        "answer": runs[0].stdout,
    }


def llama_cpp(a, limit: int) -> dict:
    """llama.cpp (llama-cpp-python, mmap) on the same file and prompt in one cgroup of `limit`: the
    peer's decode rate (mlx_flash/bench/memory_child.py, run by path: it imports nothing of this package)."""

    ids = Tokenizer(resolve_store(a.model or a.gguf, "", "source", False)).encode(PROMPT)
    drop_page_cache()
    with MemoryCgroup(limit, name="mlx_flash_peer") as cg:
        r = cg.run(
            [sys.executable, MEMORY_CHILD, "llama.cpp", a.gguf, "mmap", str(a.tokens), ",".join(map(str, ids))],
            timeout=3600,
        )
    try:
        rate = json.loads(r.stdout.strip().splitlines()[-1])["decode_tps"]
    except (ValueError, IndexError, KeyError):
        rate = None
    return {
        "config": "llama.cpp (mmap)",
        "tok_s": rate,
        "peaks": [r.peak],
        "oom_kills": r.oom_kills,
        "plans": [],
        "returncodes": [r.returncode],
        "tail": (r.stderr or r.stdout)[-400:],
    }


def run(a) -> None:
    limit = parse_budget(a.limit, 1 << 40, "--limit")
    with tempfile.TemporaryDirectory() as tmp:
        if a.batch:
            a.prompts = os.path.join(tmp, "prompts.jsonl")
            a.outputs = {False: os.path.join(tmp, "one.jsonl"), True: os.path.join(tmp, "ranks.jsonl")}
            write_prompts(a.prompts, a.batch)
        # the throughput mode compares at the same total memory: one process gets every rank's limit
        rows = [one_process(a, limit * (a.ranks if a.batch else 1)), pipeline(a, limit)]
        if a.gguf and not a.batch:
            rows.append(llama_cpp(a, limit))
        if a.batch:
            texts = [
                sorted(open(a.outputs[k]).read().splitlines()) if os.path.exists(a.outputs[k]) else []
                for k in (False, True)
            ]
            print(
                f"answers of the ranks {'equal' if texts[0] == texts[1] else 'DIFFER FROM'} the one process's "
                f"({len(texts[1])} of {a.batch})"
            )
        else:  # greedy: the same tokens, so the same text
            same = rows[0]["answer"] == rows[1]["answer"] and rows[0]["answer"]
            print(f"the ranks' answer {'equals' if same else 'DIFFERS FROM'} the one process's: {rows[1]['answer']!r}")
    base = rows[0]["tok_s"]
    if a.batch:
        print(
            f"\n{a.batch} prompts, {a.tokens} greedy tokens each; each rank in its own {fmt(limit)} memory cgroup, "
            f"one process in {fmt(limit * a.ranks)}; {a.backend} backend"
        )
    else:
        print(f"\n{a.tokens} greedy tokens, each process in its own {fmt(limit)} memory cgroup, {a.backend} backend")
    print(
        f"{'config':<22}{'tok/s' if a.batch else 'decode tok/s':>14}{'vs one':>9}"
        "  peaks per cgroup            OOM kills  exit codes"
    )
    for row in rows:
        rate = row["tok_s"]
        ratio = f"{rate / base:.2f}x" if rate and base else "-"
        peaks = ", ".join(fmt(p) for p in row["peaks"])
        print(
            f"{row['config']:<22}{rate if rate is not None else '-':>14}{ratio:>9}  {peaks:<28}{row['oom_kills']:>9}"
            f"  {row['returncodes']}"
        )
    for row in rows:
        print(f"\n{row['config']}:")
        for line in row["plans"]:
            print("  " + line)
        if row["tok_s"] is None:
            print("  (no answer) " + row["tail"])
    if a.json:
        write_json(
            a.json,
            {"limit": limit, "tokens": a.tokens, "backend": a.backend, "batch": a.batch, "rows": rows},
            OutputError,
            indent=1,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench pipeline", description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="store dir or GGUF (default: the default model)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--limit", default="2GB", help="each process's memory cgroup (default 2GB)")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--backend", default="mlx", choices=("mlx", "torch"))
    p.add_argument("--launcher", default="ring", choices=("ring", "gloo"))
    p.add_argument(
        "--batch",
        type=int,
        default=0,
        help="N prompts through the throughput mode (python -m mlx_flash.batch) instead of one chat answer",
    )
    p.add_argument(
        "--gguf",
        default=None,
        help="the model's GGUF file: llama.cpp (llama-cpp-python, mmap) decodes it too, in one cgroup of "
        "--limit (not with --batch)",
    )
    p.add_argument(
        "--engine-args",
        default="",
        help='more flags for every run of this engine, one process and ranks alike (e.g. "--context 64")',
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.ranks < 2:
        p.error("--ranks must be at least 2")
    return exit_status(lambda: run(a))
