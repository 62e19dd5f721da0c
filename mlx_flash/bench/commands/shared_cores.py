"""Decode speed when the cores are shared: one engine process alone, then N of them started together
on the same cores (two chats, a chat beside the server, anything busy), per backend.

    python -m mlx_flash.bench shared-cores [--configs mlx,torch,llama.cpp] [--processes 2] [--gen-tokens 64]
                                           [--prompt-tokens 64] [--runs 3] [--json OUT]

Each measurement is `python -m mlx_flash.bench decode --configs C` (median of --runs runs of a prompt prefill and a
greedy decode of the default model); config `llama.cpp` is the peer alone (llama-cpp-python, `make
peers`) on the same GGUF and text. The N processes start together and each reports its own rate.
Fair sharing would give each about 1/N of the one-alone rate; the table states each process's rate
and the sum against the one-alone rate, so a thread pool that keeps the cores from the threads it
waits for shows as a sum far below it.
"""

from __future__ import annotations

import argparse

import json
import os
import subprocess
import sys
import tempfile

from mlx_flash.bench.decode_pairs import peer_built
from mlx_flash.errors import first_paragraph
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError

DECODE = ["-m", "mlx_flash.bench", "decode"]  # the decode benchmark, one process per measurement


def command(config: str, a, out: str) -> list[str]:
    cmd = [sys.executable, *DECODE, "--configs", config, "--runs", str(a.runs), "--gen-tokens", str(a.gen_tokens)]
    cmd += ["--prompt-tokens", str(a.prompt_tokens), "--json", out]
    return cmd if config == "llama.cpp" else cmd + ["--no-llama-cpp"]


def decode_rates(config: str, processes: int, a, folder: str) -> list[float]:
    """Each process's median decode tokens/s, `processes` of them started together."""
    outs = [os.path.join(folder, f"{config}-{processes}-{i}.json") for i in range(processes)]
    procs = [
        subprocess.Popen(command(config, a, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for out in outs
    ]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            last = err.strip().splitlines()[-1] if err.strip() else f"exit status {p.returncode}"
            raise SystemExit(f"error: measuring {config} failed: {last}")
    rates = []
    for out in outs:
        with open(out) as fh:
            rates.append(json.load(fh)["results"][config]["decode_tps"])
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench shared-cores", description=first_paragraph(__doc__))
    p.add_argument(
        "--configs", default="mlx,torch,llama.cpp", help="the decode benchmark's configs or llama.cpp, comma list"
    )
    p.add_argument("--processes", type=int, default=2, help="processes started together (at least 2)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default="bench_results/shared_cores.json")
    a = p.parse_args(argv)
    if a.processes < 2:
        print(f"error: --processes {a.processes}: at least 2 share the cores", file=sys.stderr)
        return 2
    configs = a.configs.split(",")
    if "llama.cpp" in configs and not peer_built():
        print("llama.cpp: not installed (make peers); measuring ours alone", file=sys.stderr)
        configs.remove("llama.cpp")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for config in configs:
            alone = decode_rates(config, 1, a, folder)[0]
            shared = decode_rates(config, a.processes, a, folder)
            results[config] = {"alone": alone, "shared": shared}
    print(f"\ndecode tok/s, {os.cpu_count()} cores, {a.processes} processes at once (median of {a.runs} runs each)")
    print(f"{'config':<10}{'alone':>8}   {'each, shared':<24}{'sum':>7}{'sum / alone':>13}")
    for config, r in results.items():
        each = ", ".join(f"{x:.1f}" for x in r["shared"])
        total = sum(r["shared"])
        print(f"{config:<10}{r['alone']:>8.1f}   {each:<24}{total:>7.1f}{total / r['alone']:>13.2f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        write_json(a.json, {"processes": a.processes, "runs": a.runs, "results": results}, OutputError, indent=1)
    return 0
