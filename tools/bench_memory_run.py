"""One measured run for tools/bench_memory.py, in the process it starts (inside a memory cgroup when
a limit applies): load an engine, prefill the given token ids, decode greedily, print one JSON line.

    python tools/bench_memory_run.py mlx_flash STORE mlx|torch[:SHARE] TOKENS IDS
    python tools/bench_memory_run.py llama.cpp GGUF mmap|no-mmap TOKENS IDS

IDS: the prompt's token ids, comma-separated (the same ids for every engine). Both engines run the
same loop: one forward pass over the prompt gives the first token (time to first token, prefill
tokens/s), then TOKENS - 1 passes of one token each (decode tokens/s); greedy, EOS ignored, so
every run computes the same number of passes. Bytes read and major faults come from the kernel's
counters of this process (/proc/self/io, getrusage), not from the engine's own accounting.
SHARE: ours with ffn="sparse" and the statistical predictor drawing that share of the FFN's read
units per token (synthetic checkpoints: the reads are real, the output is noise).
A run of ours whose memory limit the planner refuses prints {"refused": message} and exits 0.

The peer's process imports nothing of mlx_flash: its memory is its own.
"""

import json
import resource
import sys
import time

import numpy as np


def read_bytes() -> int:
    """Bytes this process caused to be read from the drive (page faults on mapped files included)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("read_bytes:"))


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":")) * 1024


def counters() -> tuple[float, int, int]:
    return time.perf_counter(), read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def greedy(prefill, step, ids: list[int], tokens: int) -> dict:
    """prefill(ids) -> logits of the last position; step(token) -> logits of that token."""
    c0 = counters()
    out = [int(np.argmax(prefill(ids)))]
    c1 = counters()
    for _ in range(tokens - 1):
        out.append(int(np.argmax(step(out[-1]))))
    c2 = counters()
    passes = tokens - 1
    return {
        "prompt_tokens": len(ids),
        "tokens": tokens,
        "ttft_s": c1[0] - c0[0],
        "prefill_tps": len(ids) / (c1[0] - c0[0]),
        "decode_tps": passes / (c2[0] - c1[0]) if passes else 0.0,
        "prefill_read_bytes": c1[1] - c0[1],
        "decode_read_bytes": c2[1] - c1[1],
        "decode_read_bytes_per_token": (c2[1] - c1[1]) / passes if passes else 0.0,
        "decode_major_faults": c2[2] - c1[2],
        "generated": out,
    }


def run_ours(store: str, mode: str, tokens: int, ids: list[int]) -> dict:
    import mlx_flash
    from mlx_flash.errors import MemoryBudgetError

    backend, _, share = mode.partition(":")
    sparse = (
        {"ffn": "sparse", "flash": mlx_flash.FlashOptions(predictor="statistical", statistical_active=float(share))}
        if share
        else {}
    )
    t0 = time.perf_counter()
    try:  # "auto": the cgroup's limit less the safety margin, split by the planner (one line on stderr)
        engine = mlx_flash.load(store, backend=backend, memory_budget="auto", progress=True, **sparse)
    except MemoryBudgetError as e:
        return {"refused": str(e)}
    load_s = time.perf_counter() - t0
    with engine:
        caches = engine.new_caches()
        r = greedy(lambda x: engine.prefill(x, caches), lambda t: engine.forward([t], caches)[-1], ids, tokens)
        r.update(load_s=load_s, plan=engine.memory_plan, rss_after=status_bytes("VmRSS"))
    return r


def run_llama_cpp(gguf: str, mode: str, tokens: int, ids: list[int]) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    # logits_all=False: llama.cpp computes the last position's logits only, as ours does
    llm = Llama(
        model_path=gguf,
        n_ctx=256,
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

    r = greedy(prefill, step, ids, tokens)
    r.update(load_s=load_s, rss_after=status_bytes("VmRSS"))
    llm.close()
    return r


def main() -> int:
    engine, model, mode, tokens, ids = sys.argv[1:6]
    ids = [int(t) for t in ids.split(",")]
    run = run_ours if engine == "mlx_flash" else run_llama_cpp
    r = run(model, mode, int(tokens), ids)
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
