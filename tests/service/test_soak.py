"""The server under load inside a memory cgroup of the budget it was given: 16 clients, each holding
its own conversation (a turn, then the next with the answer included, so every conversation is a
context of its own), more contexts than the KV budget holds, for SOAK_S seconds. The cgroup is the
promise: 0 OOM kills and the server's peak RSS under the budget it planned in the cgroup (the limit
less its margin); every client completes its requests;
503s (the queue full, the KV budget unable to hold a request now) at most 5% of them; chunks moved
to flash counted from /v1/stats. Needs root and a cgroup memory controller (skipped otherwise with
the harness's reason). Default tier 20 s; the full tier (MLX_FLASH_FULL=1, or MLX_FLASH_SOAK=1 for
the soaks alone) 10 minutes.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from live_server import CHAT, chat_body, start, stop, vm_hwm

from mlx_flash.bench.cgroup import MemoryCgroup, own_memory_cgroup
from mlx_flash.errors import FlashError

pytestmark = pytest.mark.slow
SOAK_S = 600.0 if "1" in (os.environ.get("MLX_FLASH_FULL"), os.environ.get("MLX_FLASH_SOAK")) else 20.0
CLIENTS = 16
LIMIT = 1_200_000_000  # the cgroup: the default model, its runtime and the KV pool
KV_BUDGET = str(24 * 737280)  # 24 chunks of 16 tokens: fewer than 16 conversations of 2-4 chunks hold
TOPICS = ["France", "Germany", "Italy", "Spain", "Japan", "Egypt", "Canada", "Brazil"]


def test_sixteen_clients_in_a_cgroup_of_the_budget(store_dir, tmp_path):
    try:
        own_memory_cgroup()
    except FlashError as e:
        pytest.skip(str(e))
    with MemoryCgroup(LIMIT, name="mlx_flash_soak") as cg:
        # --memory-budget auto: the cgroup's limit less its margin (a budget of the whole limit is refused)
        srv = start(store_dir, str(tmp_path), "--memory-budget", "auto", kv_budget=KV_BUDGET, cgroup=cg)
        try:
            counts = {"ok": 0, "503": 0, "other": []}
            lock = threading.Lock()
            deadline = time.monotonic() + SOAK_S

            def client(c: int) -> None:
                topic = TOPICS[c % len(TOPICS)]
                while time.monotonic() < deadline:
                    history = [{"role": "user", "content": f"Client {c}: what is the capital of {topic}?"}]
                    for follow in ("And its largest river?", "Name one famous building there."):
                        status, _, data = srv.request("POST", CHAT, chat_body(history, max_tokens=8), timeout=300)
                        with lock:
                            if status == 200:
                                counts["ok"] += 1
                            elif status == 503:
                                counts["503"] += 1
                            else:
                                counts["other"].append((status, data))
                        if status != 200:
                            time.sleep(1.0)  # as Retry-After says
                            break
                        history += [
                            {"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                            {"role": "user", "content": follow},
                        ]

            threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(SOAK_S + 300)
            assert not any(t.is_alive() for t in threads), "a client hung"
            stats = srv.stats()
            hwm = vm_hwm(srv.proc.pid)
        finally:
            code = stop(srv)
        peak, ooms = cg.usage()
    total = counts["ok"] + counts["503"] + len(counts["other"])
    budget = stats["memory"]["limit"]
    print(
        f"soak {SOAK_S:.0f} s, {CLIENTS} clients: {counts['ok']} answered, {counts['503']} 503s of {total}; "
        f"server peak RSS {hwm / 1e6:.0f} MB under its budget {budget / 1e6:.0f} MB (cgroup {LIMIT / 1e6:.0f} MB, "
        f"its peak with the page cache {peak / 1e6:.0f} MB), {ooms} OOM kills; {stats['kv']['chunks_written']} "
        f"chunks written to flash, {stats['kv']['chunks_read']} read back, {stats['contexts']['total']} contexts"
    )
    assert ooms == 0 and code == 0, srv.log_text()[-3000:]
    assert hwm <= budget  # the process's own peak, under the budget the engine planned within the cgroup
    assert not counts["other"], counts["other"][:3]
    assert counts["ok"] >= CLIENTS and counts["503"] <= 0.05 * total
    assert stats["kv"]["chunks_written"] > 0  # more contexts than the budget: chunks went to flash
