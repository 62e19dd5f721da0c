"""Results that regenerate: which benchmark runs write which record, and which table of which results
page each record feeds. `python -m mlx_flash.bench results` (`make results`) runs a tier's benchmarks,
each in its own process, writing its JSON record into docs/results/records/, then rewrites the
generated sections of docs/results/*.md from the records (mlx_flash/bench/pages.py); `--render`
rewrites the pages from the records already there, running nothing.

The quick tier measures the default model and Gemma 3 270M (under 10 minutes on 2 cores, llama.cpp
built by `make peers`); the full tier large shapes on synthetic weights (mlx_flash/bench/models.py):
the Llama-2-7B shape resident and inside a 2 GB memory cgroup, the LLMS trace, the server under 16
clients, the Qwen3-30B-A3B shape's first 8 layers fed real text, the throughput mode on the Mistral-7B
shape's first 12 layers in a 2.4 GB cgroup (the cgroups need root and cgroup v1), about 20 minutes once
its synthetic checkpoints are written. A table whose record is missing says which command writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from ..errors import FlashError
from . import pages
from . import result_tables as t
from . import result_tables_big as big
from . import result_tables_service as svc
from . import result_tables_sparsity as sparsity

QUICK, FULL = "quick", "full"


@dataclass(frozen=True)
class Run:
    """One benchmark command of a tier and the record it writes (records/<record>.json)."""

    record: str
    tier: str
    args: tuple[str, ...]  # after `python -m mlx_flash.bench`; the tier adds `--json <record path>`
    minutes: float  # about how long it takes here, for the progress line

    def command(self) -> str:
        return " ".join(["python -m mlx_flash.bench", *self.args, "--json", f"docs/results/records/{self.record}.json"])


ARITH = ("arithmetic", "--models", "default,gemma", "--backends", "torch,mlx", "--arithmetics", "exact,q8")
SEVEN_B = ("--models", "7b", "--backends", "torch,mlx", "--arithmetics", "exact,q8")
RUNS = (
    Run("quick-decode", QUICK, (*ARITH, "--parts", "decode", "--pairs", "3", "--gen-tokens", "64"), 2.5),
    Run("quick-rows", QUICK, (*ARITH, "--parts", "rows"), 0.7),
    Run("quick-quality", QUICK, (*ARITH, "--parts", "quality"), 2.0),
    Run(
        "quick-prompt",
        QUICK,
        ("arithmetic", "--models", "default", "--parts", "prompt", "--prompt-tokens", "1000"),
        2.5,
    ),
    Run("quick-kernels", QUICK, ("arithmetic", "--parts", "kernels"), 1.0),
    Run(
        "full-7b-decode",
        FULL,
        ("arithmetic", *SEVEN_B, "--parts", "decode", "--pairs", "3", "--decode-prompt", "16", "--gen-tokens", "16")
        + ("--stream-gb", "4"),
        4.0,
    ),
    Run("full-service", FULL, ("service", "--patterns", "random", "--calls", "24"), 3.5),
    Run("full-concurrency", FULL, ("concurrency", "--clients", "1,16", "--max-tokens", "32"), 0.5),
    Run("full-moe-8l", FULL, ("moe", "--model", "moe-8l", "--tokens", "32"), 0.5),
    Run(
        "full-throughput",
        FULL,
        ("throughput", "--store", "mistral-12l", "--sequences", "32", "--prompt", "128", "--generate", "32")
        + ("--single-sequences", "1", "--modes", "single,row,flexgen", "--memory-budget", "2.4GB", "--cgroup"),
        8.5,
    ),
    Run(
        "full-sparsity-quality",
        FULL,
        ("sparsity", "--parts", "thresholds,quality", "--models", "default,gemma", "--recalibrate")
        + ("--levels", "0,0.2,0.25,0.3,0.4,0.5,0.6"),
        26.0,
    ),
    Run("full-sparsity-decode", FULL, ("sparsity", "--parts", "decode", "--models", "default", "--peer"), 4.0),
    Run(
        "full-sparsity-7b",
        FULL,
        ("sparsity", "--parts", "thresholds,decode", "--models", "7b", "--levels", "0.4,0.5", "--pairs", "3")
        + ("--gen-tokens", "16", "--decode-prompt", "16", "--calibration-tokens", "1024", "--allocate", "0", "--peer"),
        14.0,
    ),
    Run("full-sparse-reads", FULL, ("sparse-reads", "--models", "7b,default", "--tokens", "8"), 7.5),
    Run(
        "full-7b-2gb",
        FULL,
        ("memory", "--model", "7b", "--limits", "2GB", "--backends", "torch/exact,torch/q8", "--tokens", "8")
        + ("--prompt-tokens", "16"),
        2.5,
    ),
)


@dataclass(frozen=True)
class Table:
    """A generated section: its name in the page's markers, the page, the records it is written from
    (render takes them by name; a missing one is None)."""

    name: str
    page: str
    records: tuple[str, ...]
    render: Callable[[dict[str, dict | None]], str]


def one(record: str, fn: Callable[[dict], str]) -> Callable[[dict[str, dict | None]], str]:
    return lambda recs: fn(recs[record])


TABLES = (
    Table(
        "headline",
        "headline.md",
        ("quick-decode", "quick-prompt", "quick-quality", "full-7b-decode", "full-7b-2gb"),
        t.headline,
    ),
    Table("decode", "backends.md", ("quick-decode",), one("quick-decode", t.decode)),
    Table("prompt", "backends.md", ("quick-prompt",), one("quick-prompt", t.prompt)),
    Table("decode-7b", "backends.md", ("full-7b-decode",), one("full-7b-decode", t.decode)),
    Table("stream-7b", "backends.md", ("full-7b-decode",), one("full-7b-decode", t.stream_share)),
    Table("rows", "arithmetic.md", ("quick-rows",), one("quick-rows", t.rows_table)),
    Table("quality", "arithmetic.md", ("quick-quality",), one("quick-quality", t.quality)),
    Table("kernels", "kernels.md", ("quick-kernels",), one("quick-kernels", t.kernels)),
    Table("memory-7b", "memory-limits.md", ("full-7b-2gb",), one("full-7b-2gb", t.memory)),
    Table("service-trace", "service.md", ("full-service",), one("full-service", svc.service)),
    Table("concurrency", "service.md", ("full-concurrency",), one("full-concurrency", svc.concurrency)),
    Table("moe-8l", "experts.md", ("full-moe-8l",), one("full-moe-8l", big.moe)),
    Table(
        "sparsity-quality", "sparsity.md", ("full-sparsity-quality",), one("full-sparsity-quality", sparsity.quality)
    ),
    Table(
        "sparsity-decode",
        "sparsity.md",
        ("full-sparsity-decode", "full-sparsity-quality"),
        lambda recs: sparsity.decode(recs["full-sparsity-decode"], recs["full-sparsity-quality"]),
    ),
    Table(
        "sparsity-7b",
        "sparsity.md",
        ("full-sparsity-7b",),
        one("full-sparsity-7b", lambda rec: sparsity.decode(rec, None)),
    ),
    Table("sparse-reads", "sparsity.md", ("full-sparse-reads",), one("full-sparse-reads", sparsity.streamed_reads)),
    Table("sparse-groups", "sparsity.md", ("full-sparse-reads",), one("full-sparse-reads", sparsity.group_quality)),
    Table("throughput-mistral", "throughput.md", ("full-throughput",), one("full-throughput", big.throughput)),
)


def results_dir() -> str:
    """docs/results of the clone this package runs from; refused where there is none (an installed
    wheel has no pages to regenerate)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = os.path.join(root, "docs", "results")
    if not os.path.isdir(out):
        raise FlashError(f"{out}: no results pages here: run `python -m mlx_flash.bench results` in a clone")
    return out


def read_record(results: str, name: str) -> dict | None:
    path = os.path.join(results, "records", f"{name}.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise FlashError(f"{path}: not a readable record ({e})") from None


def stamp(name: str, rec: dict) -> str:
    """The line under a table: which record, tree, date, machine and command it comes from."""
    tree = rec.get("commit", "")[:7] or "no commit"
    edits = ", with uncommitted edits" if rec.get("dirty") else ""
    load = rec.get("load_before"), rec.get("load_after")
    busy = f"; load average {load[0][0]:.2f} before, {load[1][0]:.2f} after" if all(load) else ""
    return (
        f"_Record [`records/{name}.json`](records/{name}.json): commit `{tree}`{edits}, {rec.get('date', '')[:10]}, "
        f"{rec.get('cpu') or 'CPU unknown'}, {rec.get('cores')} cores, kernels {rec.get('kernel_path')}{busy}. "
        f"`{rec.get('command', '')}`_"
    )


def section_body(results: str, table: Table) -> str:
    """The table from its records and a stamp under it for each; while a record is missing, the
    command that writes it instead (a table of several records leaves out the rows it lacks)."""
    recs = {name: read_record(results, name) for name in table.records}
    missing = [next(r for r in RUNS if r.record == name) for name, rec in recs.items() if rec is None]
    if len(missing) == len(recs):
        said = "\n\n".join(f"_No record yet: `{run.command()}` writes it (the {run.tier} tier)._" for run in missing)
        return f"\n{said}\n"
    lines = ["", table.render(recs), ""]  # blank lines apart from the markers: a table starts a block
    lines += [stamp(name, rec) + "\n" for name, rec in recs.items() if rec is not None]
    lines += [f"_No record yet for some rows: `{run.command()}` ({run.tier} tier)._\n" for run in missing]
    return "\n".join(lines)


def render(results: str) -> list[str]:
    """Rewrite every generated section of every page from its record; the pages changed. A page
    without a section a table names, or a section no table names, is refused: the two lists agree."""
    changed = []
    by_page: dict[str, list[Table]] = {}
    for table in TABLES:
        by_page.setdefault(table.page, []).append(table)
    for page in sorted(f for f in os.listdir(results) if f.endswith(".md")):
        path = os.path.join(results, page)
        with open(path) as fh:
            text = fh.read()
        names = {s.name for s in pages.sections(text, page)}
        want = {tb.name for tb in by_page.get(page, [])}
        if names != want:
            missing, unknown = sorted(want - names), sorted(names - want)
            raise FlashError(f"docs/results/{page}: sections {missing} missing, {unknown} not a known table")
        new = pages.replace(text, {tb.name: section_body(results, tb) for tb in by_page.get(page, [])}, page)
        if new != text:
            with open(path, "w") as fh:  # (not durable: a page of the source tree, git holds it)
                fh.write(new)
            changed.append(page)
    return changed


def run_tier(results: str, tier: str, only: list[str] | None = None, say=print) -> list[str]:
    """Run the tier's benchmarks (or only the records named), one process each, in order; the records
    whose run failed (each said in one line with its exit status; the others still run)."""
    runs = [r for r in RUNS if r.tier == tier and (not only or r.record in only)]
    if only and len(runs) != len(only):
        known = ", ".join(r.record for r in RUNS if r.tier == tier)
        raise FlashError(
            f"--only: {', '.join(sorted(set(only) - {r.record for r in runs}))} not in the {tier} tier ({known})"
        )
    failed = []
    root = os.path.dirname(os.path.dirname(results))
    for i, run in enumerate(runs, 1):
        say(f"[{i}/{len(runs)}] {run.record} (about {run.minutes:g} min): {run.command()}")
        # the record's path as the command names it, relative to the clone: a record holds no path
        # of the machine it ran on
        path = os.path.join("docs", "results", "records", f"{run.record}.json")
        cmd = [sys.executable, "-m", "mlx_flash.bench", *run.args, "--json", path]
        code = subprocess.run(cmd, cwd=root).returncode
        if code != 0:
            say(f"  {run.record}: the benchmark exited with status {code}; its record is left as it was")
            failed.append(run.record)
    return failed
