"""Process memory of a user's first minutes: RSS after load() + 16 generated tokens, the peak RSS, and
which heavy frameworks the process imported, per backend, each in a fresh process (median of N).

    python tools/bench_memory.py [--model PATH] [--configs mlx,torch] [--tokens 16] [--runs 3]

The model is converted first (in this process), so the measured processes only load and generate.
"""

import argparse
import json
import statistics
import subprocess
import sys

from mlx_flash.config import default_cache_dir
from mlx_flash.default_model import resolve_store
from mlx_flash.errors import exit_status, first_paragraph

CHILD = """
import json, sys
import mlx_flash
store, backend, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
with mlx_flash.load(store, backend=backend, progress=False) as e:
    text = e.generate("The capital of France is", max_tokens=tokens, temperature=0)
    rss = int(open("/proc/self/statm").read().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE")
    # VmHWM, the peak of this process image: ru_maxrss would carry the parent's peak across fork + exec
    hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
    print(json.dumps({"rss_mb": rss / 1e6, "peak_mb": hwm / 1e6,
                      "imported": sorted(m for m in ("torch", "transformers", "mlx_lm") if m in sys.modules),
                      "text": text}))
"""


def measure(store: str, backend: str, tokens: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, store, backend, str(tokens)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: the {backend} run failed: {r.stderr.strip().splitlines()[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--model", default=None, help="store, GGUF or HF dir (default: the default model)")
    p.add_argument("--configs", default="mlx,torch", help="backends to measure (default: mlx,torch)")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated before measuring (default: 16)")
    p.add_argument("--runs", type=int, default=3, help="fresh processes per backend; medians reported")
    a = p.parse_args()

    def body():
        store = resolve_store(a.model, default_cache_dir())
        print(f"store: {store}\n{'backend':8} {'RSS after (MB)':>15} {'peak RSS (MB)':>14}  imported")
        for backend in a.configs.split(","):
            runs = [measure(store, backend, a.tokens) for _ in range(a.runs)]
            rss = statistics.median(r["rss_mb"] for r in runs)
            peak = statistics.median(r["peak_mb"] for r in runs)
            print(f"{backend:8} {rss:15.0f} {peak:14.0f}  {', '.join(runs[0]['imported']) or '-'}"
                  f"   ({a.tokens} tokens: {runs[0]['text']!r})")

    return exit_status(body)


if __name__ == "__main__":
    sys.exit(main())
