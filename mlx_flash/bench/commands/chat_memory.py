"""What the default chat holds after a short exchange, beside llama.cpp at the same context.

    python -m mlx_flash.bench chat-memory [--backends torch,mlx] [--question TEXT] [--max-tokens 24]
                                          [--json bench_results/chat_memory.json]

Ours: `python -m mlx_flash.chat` (default model, default options but --backend and --max-tokens) as a
user runs it, one question, then `/stats`; the process's resident memory (VmRSS of /proc) is read
while it waits for the next line, beside the "held now" that /stats printed. llama.cpp
(llama-cpp-python, `make peers`): the same GGUF with n_ctx the context our chat planned, the
same question as a chat completion, then its process's VmRSS. Both processes are Python with
their engine imported; nothing else runs in them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from mlx_flash.errors import first_paragraph
from mlx_flash.default_model import default_model_path
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError

LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=2, verbose=False)
llm.create_chat_completion(messages=[{"role": "user", "content": sys.argv[3]}], max_tokens=int(sys.argv[4]),
                           temperature=0)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS")))
"""


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))


def ours(backend: str, question: str, max_tokens: int) -> dict:
    """The chat's VmRSS after one answer and /stats, its /stats line and the context it planned."""
    cmd = [sys.executable, "-m", "mlx_flash.chat", "--backend", backend, "--max-tokens", str(max_tokens)]
    with tempfile.TemporaryFile("w+") as errors:  # (a file: a pipe nobody reads could fill and stall the chat)
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True)
        p.stdin.write(f"{question}\n/stats\n")
        p.stdin.flush()
        lines = []
        for line in p.stdout:  # the answer, then /stats, whose last line is the memory one
            lines.append(line.rstrip("\n"))
            if line.startswith("memory:"):
                break
        rss = rss_kb(p.pid) * 1024 if p.poll() is None else None
        p.stdin.close()
        p.wait(timeout=60)
        errors.seek(0)
        err = errors.read()
    stats = next((x for x in lines if x.startswith("memory:")), None)
    if rss is None or stats is None:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit status {p.returncode}"
        raise SystemExit(f"error: the {backend} chat ended before /stats: {last}")
    held = float(re.search(r"memory: (\d+) MB held now", stats).group(1)) * 1e6
    context = int(re.search(r"KV planned for (\d+) tokens", stats).group(1))
    answer = next((x for x in lines if x.strip()), "")
    return {"rss": rss, "stats_held": held, "context": context, "answer": answer}


def llama_cpp(context: int, question: str, max_tokens: int) -> int | str:

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "not installed (make peers)"
    args = [default_model_path(), str(context), question, str(max_tokens)]
    r = subprocess.run([sys.executable, "-c", LLAMA, *args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return f"failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    return int(r.stdout.split()[-1]) * 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench chat-memory", description=first_paragraph(__doc__))
    p.add_argument("--backends", default="torch,mlx")
    p.add_argument("--question", default="What is the capital of France?")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--json", default="bench_results/chat_memory.json")
    a = p.parse_args(argv)
    rows = {b: ours(b, a.question, a.max_tokens) for b in a.backends.split(",")}
    contexts = sorted({r["context"] for r in rows.values()})
    peers = {c: llama_cpp(c, a.question, a.max_tokens) for c in contexts}
    print(f"\nafter one question ({a.question!r}, up to {a.max_tokens} tokens), resident memory (VmRSS):")
    print(f"{'engine':<22}{'context':>8}{'RSS MB':>9}{'/stats MB':>11}{'vs llama.cpp':>14}")
    for b, r in rows.items():
        peer = peers[r["context"]]
        ratio = f"{r['rss'] / peer:.2f}x" if isinstance(peer, int) else "-"
        print(f"{'ours, ' + b:<22}{r['context']:>8}{r['rss'] / 1e6:>9.0f}{r['stats_held'] / 1e6:>11.0f}{ratio:>14}")
    for c, peer in peers.items():
        shown = f"{peer / 1e6:>9.0f}" if isinstance(peer, int) else f"  {peer}"
        print(f"{'llama.cpp':<22}{c:>8}{shown}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        write_json(a.json, {"ours": rows, "llama.cpp": {str(c): v for c, v in peers.items()}}, OutputError, indent=1)
    return 0
