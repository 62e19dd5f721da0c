"""One measured run of the memory benchmarks (python -m mlx_flash.bench memory, long-context,
pipeline), in the process they start (inside a memory cgroup when a limit applies): load an engine,
prefill the given token ids, decode greedily, print one JSON line.

    python mlx_flash/bench/memory_child.py mlx_flash STORE mlx|torch[:SHARE] TOKENS IDS [--fed IDS]
                                           [--read-log OUT] [--context N] [--no-kv-on-flash] [--kv-flash-bits B]
    python mlx_flash/bench/memory_child.py llama.cpp GGUF mmap|no-mmap TOKENS IDS [--fed IDS]

IDS: the prompt's token ids, comma-separated (the same ids for every engine). Both engines run the
same loop: one forward pass over the prompt gives the first token (time to first token, prefill
tokens/s), then TOKENS - 1 passes of one token each (decode tokens/s); greedy, EOS ignored, so
every run computes the same number of passes. --fed: teacher forcing, the MoE benchmarks' way: pass
i is fed the i-th of these ids (the text's next token) instead of the engine's own pick, so routing
follows real text. --read-log (ours, streamed experts): the byte ranges the decode passes read, per
reader batch, as JSON, for the parent to read again after dropping the page cache; the expert
cache's decode hit rate is reported either way. Bytes read and major faults come from the kernel's
counters of this process (/proc/self/io, getrusage), not from the engine's own accounting.
SHARE: ours with ffn="sparse" and the statistical predictor drawing that share of the FFN's read
units per token (synthetic checkpoints: the reads are real, the output is noise).
A run of ours whose memory limit the planner refuses prints {"refused": message} and exits 0.

This process's memory is what is measured, so it imports nothing of mlx_flash at start: the parent
runs this file by its path (mlx_flash.bench.cgroup:MEMORY_CHILD), never as `-m mlx_flash.bench...`,
which would import the package (mlx_flash/__init__.py and what it loads) first. The peer's run never
imports it, so its memory is its own; ours imports the engine when it loads it, as a user's program
would. Keep it so: standard library and numpy only at module level.
"""

import os
import sys

# Run by path, this file's folder (mlx_flash/bench/) comes first on sys.path, where a sibling module
# named like a standard one would shadow it; the folder is taken off.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402


def read_bytes() -> int:
    """Bytes this process caused to be read from the drive (page faults on mapped files included)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("read_bytes:"))


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":")) * 1024


def counters() -> tuple[float, int, int]:
    return time.perf_counter(), read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def decode(prefill, step, ids: list[int], tokens: int, fed: list[int] | None = None, on_decode=None) -> dict:
    """prefill(ids) -> logits of the last position; step(token) -> logits of that token. Each
    step takes the previous pick (greedy) or, with `fed`, the next fed token. on_decode(): called
    once the prompt's pass is done."""
    c0 = counters()
    out = [int(np.argmax(prefill(ids)))]
    c1 = counters()
    if on_decode is not None:
        on_decode()
        c1 = counters()
    for i in range(tokens - 1):
        out.append(int(np.argmax(step(fed[i] if fed else out[-1]))))
    c2 = counters()
    passes = tokens - 1
    return {
        "prompt_tokens": len(ids),
        "tokens": tokens,
        "teacher_forced": bool(fed),
        "ttft_s": c1[0] - c0[0],
        "prefill_tps": len(ids) / (c1[0] - c0[0]),
        "decode_tps": passes / (c2[0] - c1[0]) if passes else 0.0,
        "prefill_read_bytes": c1[1] - c0[1],
        "decode_read_bytes": c2[1] - c1[1],
        "decode_read_bytes_per_token": (c2[1] - c1[1]) / passes if passes else 0.0,
        "decode_major_faults": c2[2] - c1[2],
        "generated": out,
    }


class RecordingPool:
    """A reader pool that notes the (path, offset, length) of every batch submitted while `on`."""

    def __init__(self, pool):
        self.pool, self.on, self.batches = pool, False, []

    def submit(self, ranges, priority: int = 0):
        ranges = list(ranges)
        if self.on:
            self.batches.append([(f.path, int(off), int(n)) for f, off, n, _ in ranges])
        return self.pool.submit(ranges, priority)

    def read(self, ranges, priority: int = 0):
        return self.submit(ranges, priority).wait()

    def __getattr__(self, name):
        return getattr(self.pool, name)


def run_ours(
    store: str, mode: str, tokens: int, ids: list[int], fed=None, read_log=None, kv: dict | None = None
) -> dict:
    import mlx_flash  # deferred: the llama.cpp child must not import the package (its memory is measured)
    from mlx_flash.errors import MemoryBudgetError  # deferred: as above
    from mlx_flash.moe.experts import StreamedExperts  # deferred: as above

    backend, _, share = mode.partition(":")
    backend, _, arithmetic = backend.partition("/")  # "torch/q8": the backend and the arithmetic
    sparse = (
        {"ffn": "sparse", "flash": mlx_flash.FlashOptions(predictor="statistical", statistical_active=float(share))}
        if share
        else {}
    )
    t0 = time.perf_counter()
    try:  # "auto": the cgroup's limit less the safety margin, split by the planner (one line on stderr)
        engine = mlx_flash.load(
            store,
            backend=backend,
            arithmetic=arithmetic or "auto",
            memory_budget="auto",
            progress=True,
            **sparse,
            **(kv or {}),
        )
    except MemoryBudgetError as e:
        return {"refused": str(e)}
    load_s = time.perf_counter() - t0
    with engine:
        recorder = None
        if read_log and isinstance(engine.ffn, StreamedExperts):
            recorder = engine.ffn.pool = RecordingPool(engine.ffn.pool)
        hits, kv_read = [], []

        def start_decode():
            hits.append(expert_hits(engine))
            kv_read.append(engine.kv_bytes_read)
            if recorder is not None:
                recorder.on = True

        caches = engine.new_caches()
        r = decode(
            lambda x: engine.prefill(x, caches),
            lambda t: engine.forward([t], caches)[-1],
            ids,
            tokens,
            fed,
            start_decode,
        )
        h, m = (b - a for a, b in zip(hits[0], expert_hits(engine)))
        r.update(load_s=load_s, plan=engine.memory_plan, rss_after=status_bytes("VmRSS"))
        r.update(expert_hit_rate=h / (h + m) if h + m else None)
        # KV tiers: what the decode read back of the older tokens on flash (page cache hits included)
        r.update(decode_kv_read_bytes_per_token=(engine.kv_bytes_read - kv_read[0]) / max(tokens - 1, 1))
        if recorder is not None:
            with open(read_log, "w") as fh:  # (not durable: read by the parent within this run)
                json.dump({"threads": recorder.pool.threads, "batches": recorder.batches}, fh)
    return r


def expert_hits(engine) -> tuple[int, int]:
    """(hits, misses) of the expert cache over every layer since load; (0, 0) with no cache."""
    per_layer = engine.ffn.stats().expert_hits
    return tuple(map(sum, zip(*per_layer))) if per_layer else (0, 0)


def run_llama_cpp(gguf: str, mode: str, tokens: int, ids: list[int], fed=None) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    # logits_all=False: llama.cpp computes the last position's logits only, as ours does
    llm = Llama(
        model_path=gguf,
        n_ctx=max(256, len(ids) + tokens + 8),
        n_threads=2,
        n_threads_batch=2,
        use_mmap=mode == "mmap",
        logits_all=False,
        verbose=False,
    )
    load_s = time.perf_counter() - t0

    def last_logits():  # the last evaluated position's logits, read in place
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    def prefill(x):
        llm.eval(x)
        return last_logits()

    def step(t):
        llm.eval([t])
        return last_logits()

    r = decode(prefill, step, ids, tokens, fed)
    r.update(load_s=load_s, rss_after=status_bytes("VmRSS"))
    llm.close()
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=["mlx_flash", "llama.cpp"])
    p.add_argument("model")
    p.add_argument("mode")
    p.add_argument("tokens", type=int)
    p.add_argument("ids")
    p.add_argument("--fed", default="")
    p.add_argument("--read-log", default=None)
    p.add_argument("--context", type=int, default=0, help="ours: the KV context to plan (0: auto)")
    p.add_argument("--no-kv-on-flash", action="store_true", help="ours: every token's KV resident")
    p.add_argument("--kv-flash-bits", type=int, default=0, help="ours: the KV tiers' tokens on flash at B bits")
    a = p.parse_args()
    ids = [int(t) for t in a.ids.split(",")]
    fed = [int(t) for t in a.fed.split(",")] if a.fed else None
    if fed is not None and len(fed) < a.tokens - 1:
        p.error(f"--fed has {len(fed)} ids; {a.tokens - 1} decode passes need one each")
    if a.engine == "mlx_flash":
        kv = {"context": a.context, "kv_on_flash": not a.no_kv_on_flash, "kv_flash_bits": a.kv_flash_bits}
        r = run_ours(a.model, a.mode, a.tokens, ids, fed, a.read_log, kv)
    else:
        r = run_llama_cpp(a.model, a.mode, a.tokens, ids, fed)
    # VmHWM: the peak of this process image (ru_maxrss would carry the parent's peak across fork + exec)
    r.update(
        vmhwm=status_bytes("VmHWM"),
        read_bytes=read_bytes(),
        major_faults=resource.getrusage(resource.RUSAGE_SELF).ru_majflt,
        imported=sorted(m for m in ("torch", "transformers", "mlx_lm") if m in sys.modules),
    )
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
