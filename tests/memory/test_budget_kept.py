"""memory_budget kept, measured: the chat's peak RSS (the kernel's VmHWM of the process, read by its
parent) against the budget, on the default model, for each backend. A budget below what the process
reaches before it can plan is refused naming that number; at that number the planner refuses naming
the model's minimum, without passing the budget on the way; at the minimum and at twice it a short
answer comes with the peak within the budget. Each run is a fresh process (a backend's import, a
tokenizer and the plan's floor are part of what is measured)."""

import importlib.util
import re
import sys

import pytest

from mlx_flash.bench.budget_kept import BEFORE_PLAN, MINIMUM, chat_at
from progress_lines import without_progress

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB: Linux"),
]

MB = 10**6


def chat(backend: str, budget: int, store_dir: str) -> tuple[int, str, int]:
    """(exit status, stderr without the peak line, peak RSS bytes) of a one-shot chat at `budget` bytes."""
    r = chat_at(backend, budget, store_dir)
    assert r["peak"] is not None, r["stderr"][-2000:]
    return r["code"], r["stderr"], r["peak"]


def refusal(backend: str, budget: int, store_dir: str, pattern: str) -> tuple[int, int, str]:
    """(the number a refusal at `budget` names, the refused process's peak, the refusal)."""
    code, err, peak = chat(backend, budget, store_dir)
    # one line (a first use may print progress before it: a fresh store's checksums, a kernel build)
    lines = without_progress(err)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    m = re.search(pattern, lines[0])
    assert m, lines[0]
    return int(float(m.group(1)) * MB), peak, lines[0]


@pytest.fixture(scope="module")
def minimum(store_dir):
    """backend -> (what it reaches before planning, the model's minimum, the peak of the run refused
    at the first, the two refusals), each as the refusals name them."""
    if importlib.util.find_spec("torch") is not None:  # built here, not inside a measured chat (one line each)
        from mlx_flash.kernels import torch_ops

        torch_ops.ops()
    out = {}
    for b in ("mlx", "torch"):
        before, _, first = refusal(b, 1_000_000, store_dir, BEFORE_PLAN)
        least, peak, second = refusal(b, before, store_dir, MINIMUM)
        out[b] = before, least, peak, f"{first}\n{second}"
    return out


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_the_refusal_names_the_minimum_and_keeps_the_budget(minimum, backend):
    before, least, peak, said = minimum[backend]
    assert least > before
    assert peak <= before, f"{backend}: refused at {before / MB:.1f} MB after peaking at {peak / MB:.1f} MB\n{said}"


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("times", [1, pytest.param(2, marks=pytest.mark.full)])  # 2x the minimum: ~20 s each more
def test_peak_rss_within_the_budget(minimum, store_dir, backend, times):
    budget = times * minimum[backend][1]
    code, err, peak = chat(backend, budget, store_dir)
    assert code == 0, err[-2000:]
    assert re.search(r"generated [1-9][0-9]* tok", err), err[-2000:]
    plan = "\n".join(line for line in err.splitlines() if line.startswith("memory: "))
    assert peak <= budget, f"{backend} at {budget / MB:.1f} MB: peak RSS {peak / MB:.1f} MB\n{plan}"
