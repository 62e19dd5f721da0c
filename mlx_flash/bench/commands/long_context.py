"""A conversation longer than memory: the engine inside a memory cgroup with a long prompt, its KV's
older tokens on flash (KV tiers), against the same run at a limit that holds every token resident,
and llama.cpp in the same cgroup with a context as long; each run a fresh process, the page cache
dropped before it.

    python -m mlx_flash.bench long-context --model GGUF_OR_STORE [--limit 2GB] [--prompt-tokens 3500]
        [--tokens 500] [--short-tokens 32] [--resident-limit 20GB] [--backend mlx] [--peer llama.cpp|none]
        [--gguf GGUF] [--rows short,long,coded,resident,peer] [--kv-flash-bits 4] [--json OUT]

Rows: ours at the limit with a short prompt (the short-context rate), with and without KV tiers
(their read buffers come out of the weights' share); ours at the limit with the long prompt; ours
with the long prompt at --resident-limit, --no-kv-on-flash and the conversation's context planned
(every token resident: the tokens must be the same); llama.cpp at the limit (n_ctx = prompt +
tokens + 8; its rate or its failure). Row "coded" (not run by default): the long run with the
tokens on flash at --kv-flash-bits bits, its decode rate beside the exact tiers'. The prompt is the
Wikipedia corpus's first tokens (the same ids for every engine); decode is greedy. For each long run
at the limit: the bytes the kernel read per decoded token (weights and KV, /proc/self/io), the KV
bytes the tiers read back per token (the engine's count; some from the page cache), and the drive's
read rate (bench/cgroup.read_bandwidth), so that the time per token stands beside (weights + KV
bytes) / rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mlx_flash.bench.cgroup import MEMORY_CHILD, MemoryCgroup, drop_page_cache, read_bandwidth
from mlx_flash.calibrate import read_corpus
from mlx_flash.config import default_cache_dir
from mlx_flash.default_model import resolve_store
from mlx_flash.errors import FlashError
from mlx_flash.budget import parse_budget
from mlx_flash.tokenizer import Tokenizer
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError

ROWS = {"short", "long", "coded", "resident", "peer"}


def corpus_ids(store: str, n: int) -> list[int]:
    ids = Tokenizer(store).encode(read_corpus("wikipedia")[: 12 * n])
    if len(ids) < n:
        raise FlashError(f"the Wikipedia text encodes to {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def run(engine: str, model: str, mode: str, limit: int, tokens: int, ids: list[int], timeout: float, extra=()) -> dict:
    """One child of mlx_flash/bench/memory_child.py in a fresh cgroup of `limit` bytes, cold page cache."""
    drop_page_cache()
    cmd = [sys.executable, MEMORY_CHILD, engine, model, mode, str(tokens), ",".join(map(str, ids)), *extra]
    with MemoryCgroup(limit) as cg:
        r = cg.run(cmd, timeout=timeout)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    out = json.loads(lines[-1]) if r.returncode == 0 and lines else {}
    if not out:
        tail = "timed out" if r.timed_out else (r.stderr.strip().splitlines() or ["no output"])[-1]
        out = {"failed": tail}
    plan = next((line for line in r.stderr.splitlines() if line.startswith("memory: limit")), "")
    out.update(peak=r.peak, oom_kills=r.oom_kills, wall_s=r.wall_s, plan_line=plan, limit=limit)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench long-context", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a GGUF (converted first, outside any limit) or a store")
    p.add_argument("--gguf", default=None, help="the GGUF llama.cpp reads (default: --model when it is one)")
    p.add_argument("--limit", default="2GB")
    p.add_argument("--resident-limit", default="20GB", help="a limit whose plan holds every token resident")
    p.add_argument("--prompt-tokens", type=int, default=3500)
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--short-tokens", type=int, default=32, help="the short prompt's tokens")
    p.add_argument("--backend", default="mlx", choices=["mlx", "torch"])
    p.add_argument("--peer", default="llama.cpp", choices=["llama.cpp", "none"])
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds a run of ours may take")
    p.add_argument("--peer-timeout", type=float, default=1200, help="seconds the peer's run may take")
    p.add_argument(
        "--rows",
        default="short,long,resident,peer",
        help="which runs, comma-separated: short (a short prompt, with and without tiers), long, coded (the "
        "long run compressed on flash), resident (the long run with every token resident), peer",
    )
    p.add_argument("--kv-flash-bits", type=int, default=4, choices=(8, 4, 2), help="the coded row's width")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    wanted = set(a.rows.split(","))
    if wanted - ROWS:
        p.error(f"--rows: {', '.join(sorted(wanted - ROWS))} unknown (choose from {', '.join(sorted(ROWS))})")
    try:
        limit, resident = (
            parse_budget(v, 0, what) for v, what in ((a.limit, "--limit"), (a.resident_limit, "--resident-limit"))
        )
        store = resolve_store(a.model, default_cache_dir(), "source", progress=True)
        gguf = a.gguf or (a.model if a.model.endswith(".gguf") else None)
        ids = corpus_ids(store, a.prompt_tokens + a.short_tokens)
        long_ids, short_ids = ids[: a.prompt_tokens], ids[: a.short_tokens]
        rate = read_bandwidth(os.path.join(store, "ffn_bundles.bin"))
        # every token resident: the whole conversation's KV planned, none of it on flash
        all_resident = ["--context", str(a.prompt_tokens + a.tokens), "--no-kv-on-flash"]
        rows = {}
        if "short" in wanted:
            rows["ours, short"] = run("mlx_flash", store, a.backend, limit, 16, short_ids, a.timeout)
            # what the tiers' buffers cost a short chat: the same without them (the plan's KV share only)
            rows["ours, short, --no-kv-on-flash"] = run(
                "mlx_flash", store, a.backend, limit, 16, short_ids, a.timeout, ["--no-kv-on-flash"]
            )
        if "long" in wanted:
            rows["ours, long"] = run("mlx_flash", store, a.backend, limit, a.tokens, long_ids, a.timeout)
        if "coded" in wanted:
            bits = ["--kv-flash-bits", str(a.kv_flash_bits)]
            rows[f"ours, long, {a.kv_flash_bits}-bit on flash"] = run(
                "mlx_flash", store, a.backend, limit, a.tokens, long_ids, a.timeout, bits
            )
        if "resident" in wanted:
            rows["ours, long, all resident"] = run(
                "mlx_flash", store, a.backend, resident, a.tokens, long_ids, a.timeout, all_resident
            )
        if "peer" in wanted and a.peer == "llama.cpp" and gguf:
            rows["llama.cpp, long"] = run("llama.cpp", gguf, "mmap", limit, a.tokens, long_ids, a.peer_timeout)
    except (FlashError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report(rows, rate, a)
    if a.json:
        write_json(a.json, {"disk_bytes_per_s": rate, "args": vars(a), "rows": rows}, OutputError, indent=1)
    return 0


def report(rows: dict, rate: float, a) -> None:
    print(f"drive read rate {rate / 1e9:.2f} GB/s; prompt {a.prompt_tokens} tokens, {a.tokens} generated")
    print(
        "| run | limit | decode tok/s | prefill tok/s | read MB/token (kernel) | KV read back MB/token | peak MB "
        "| OOM |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "failed" in r or "refused" in r:
            print(
                f"| {name} | {r['limit'] / 1e6:.0f} MB | {r.get('failed') or r.get('refused')} | | | | "
                f"{r['peak'] / 1e6:.0f} | {r['oom_kills']} |"
            )
            continue
        kv = r.get("decode_kv_read_bytes_per_token")
        print(
            f"| {name} | {r['limit'] / 1e6:.0f} MB | {r['decode_tps']:.3f} | {r['prefill_tps']:.2f} | "
            f"{r['decode_read_bytes_per_token'] / 1e6:.0f} | {'-' if kv is None else f'{kv / 1e6:.0f}'} | "
            f"{r['peak'] / 1e6:.0f} | {r['oom_kills']} |"
        )
    long, res = rows.get("ours, long", {}), rows.get("ours, long, all resident", {})
    if "generated" in long and "generated" in res:
        print(f"tokens equal to the all-resident run: {long['generated'] == res['generated']}")
    for name, r in rows.items():
        if not name.startswith("ours, long") or "all resident" in name or "decode_tps" not in r:
            continue
        per_token = 1 / r["decode_tps"] if r["decode_tps"] else float("inf")
        kernel = r["decode_read_bytes_per_token"]
        print(
            f"{name}, at {a.prompt_tokens}+ tokens: {per_token:.2f} s per token; the kernel read {kernel / 1e6:.0f} MB "
            f"per token, which at {rate / 1e9:.2f} GB/s takes {kernel / rate:.2f} s ({per_token * rate / kernel:.2f}x)"
        )
    coded = rows.get(f"ours, long, {a.kv_flash_bits}-bit on flash", {})
    if "decode_tps" in coded and long.get("decode_tps"):
        print(f"{a.kv_flash_bits}-bit on flash decodes {coded['decode_tps'] / long['decode_tps']:.2f}x the exact tiers")
    for name, r in rows.items():
        if r.get("plan_line"):
            print(f"{name}: {r['plan_line']}")
