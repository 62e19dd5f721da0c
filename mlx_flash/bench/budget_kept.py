"""memory_budget against the peak RSS it allows, measured as a user meets it: a one-shot chat answer
at a budget, in a fresh process (a backend's import, the tokenizer and the plan's floor are part of
what is measured), its peak RSS read by its parent (the kernel's VmHWM of its one child), optionally
inside a memory cgroup of the budget's size. Used by `python -m mlx_flash.bench memory --kept` and
tests/memory/test_budget_kept.py."""

from __future__ import annotations

import re
import subprocess
import sys

from ..errors import FlashError
from .cgroup import MemoryCgroup

PROMPT = "Write a short poem about the sea."
# The chat's parent: its children's ru_maxrss is the chat's VmHWM (the one child it waits for).
PEAK = (
    "import resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[1:])\n"
    "print('peak', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr)\n"
    "sys.exit(r.returncode)\n"
)
BEFORE_PLAN = r"below the ([0-9.]+) MB this process reaches"
MINIMUM = r"below the minimum ([0-9.]+) MB for this model"


def chat_at(backend: str, budget: int, model: str | None = None, cgroups: bool = False, timeout: float = 600) -> dict:
    """One chat answer at `budget` bytes: exit status, peak RSS, its stderr (less the peak line), the
    error line, tokens generated, OOM kills (None outside a cgroup)."""
    cmd = [
        sys.executable,
        "-c",
        PEAK,
        sys.executable,
        "-m",
        "mlx_flash.chat",
        "--prompt",
        PROMPT,
        "--max-tokens",
        "32",
        "--verbose",
        "--backend",
        backend,
        "--memory-budget",
        str(budget),
    ]
    cmd += ["--model", model] if model else []
    if cgroups:
        with MemoryCgroup(-(-budget // 4096) * 4096) as cg:  # the kernel rounds a limit down to a page
            r = cg.run(cmd, timeout=timeout)
        code, err, ooms = r.returncode, r.stderr, r.oom_kills
    else:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        code, err, ooms = r.returncode, r.stderr, None
    lines = err.rstrip().splitlines()
    peak = int(lines[-1].split()[1]) if lines and lines[-1].startswith("peak ") else None
    if peak is not None:
        lines = lines[:-1]
    gen = re.search(r"generated (\d+) tok", err)
    return {
        "backend": backend,
        "budget": budget,
        "code": code,
        "peak": peak,
        "oom_kills": ooms,
        "stderr": "\n".join(lines),
        "error": next((ln for ln in lines if ln.startswith("error: ")), ""),
        "tokens": int(gen.group(1)) if gen else 0,
    }


def named(run: dict, pattern: str) -> int:
    """The number of bytes a refusal names (pattern: BEFORE_PLAN or MINIMUM)."""
    m = re.search(pattern, run["error"])
    if not m:
        raise FlashError(
            f"{run['backend']} at {run['budget'] / 1e6:.1f} MB was not refused as expected: "
            f"{run['error'] or 'exit ' + str(run['code'])}"
        )
    return int(float(m.group(1)) * 1e6)


def kept_rows(backends, model: str | None, cgroups: bool) -> list[dict]:
    """Per backend: the run refused at what the process reaches before planning (naming the minimum),
    then runs at the minimum and at twice it."""
    rows = []
    for b in backends:
        before = named(chat_at(b, 1_000_000, model), BEFORE_PLAN)  # (the interpreter alone is more than 1 MB)
        refused = chat_at(b, before, model, cgroups)
        minimum = named(refused, MINIMUM)
        rows.append({**refused, "what": "below the minimum"})
        for times, what in ((1, "the minimum"), (2, "twice the minimum")):
            rows.append({**chat_at(b, times * minimum, model, cgroups), "what": what})
    return rows
