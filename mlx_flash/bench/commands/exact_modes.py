"""Greedy tokens, a hash of every step's logits, bytes read and read counts of every exact FFN mode,
and the text generate() makes (greedy with a stop string, and sampled from a seed) and, for the dense
model's resident and stream modes, generate_batch's, as JSON: run it on two checkouts and
compare, to show a change left behaviour and I/O alone.

    python -m mlx_flash.bench exact-modes [--moe DIR] [--budget 80%] [--tokens 24] [--out FILE]

Dense modes run on the default model (both backends: resident, stream, and every sparse mode with
every neuron active, at --budget: default 80%, since the default store's attention and embeddings
alone are half its bytes and 50% is below every sparse mode's minimum); --moe adds a MoE model's
resident and streamed experts (edgemoe and lru caches at --moe-budget, default 50%, preloading off).
"""

import argparse
import hashlib
import json
import sys

import numpy as np

import mlx_flash
from mlx_flash.durable import write_durably
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.store.atomic_dir import OutputError

PROMPT = "The history of the city begins in the twelfth century, when a small market grew along the river"
STOP = ["river", "\n\n"]  # a stop string the greedy text may meet, cut where it starts
BATCH = [PROMPT, "Once upon a time", "The capital of France is"]
SPARSE_MODES = ("naive", "hybrid", "predictor", "window", "all")


def greedy(engine, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    caches, tokens = engine.new_caches(), []
    logits = [np.asarray(engine.forward(prompt, caches)).reshape(-1)]
    for _ in range(n):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(np.asarray(engine.forward([tokens[-1]], caches)).reshape(-1))
    return tokens, np.stack(logits)


def configs(moe: str | None, budget: str, moe_budget: str = "50%"):
    for backend in ("torch", "mlx"):
        for ffn in ("resident", "stream"):
            yield None, {"backend": backend, "ffn": ffn}
        for mode in SPARSE_MODES:
            yield (
                None,
                {
                    "backend": backend,
                    "ffn": "sparse",
                    "weights_budget": budget,
                    "flash": mlx_flash.FlashOptions(mode=mode, predictor="dense"),
                },
            )
    if moe:
        yield moe, {"backend": "torch", "ffn": "resident"}
        for policy in ("edgemoe", "lru"):
            yield (
                moe,
                {
                    "backend": "torch",
                    "ffn": "stream",
                    "weights_budget": moe_budget,
                    "experts": mlx_flash.ExpertOptions(policy=policy, preload=0),
                },
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench exact-modes", description=first_paragraph(__doc__))
    p.add_argument("--moe", default=None, help="a MoE model or store to include (e.g. from tools/moefy.py)")
    p.add_argument("--budget", default="80%", help="memory budget of the sparse modes (default 80%%)")
    p.add_argument(
        "--moe-budget",
        default="50%",
        help="weights budget of the streamed MoE runs (default 50%%; a tiny model needs more)",
    )
    p.add_argument("--tokens", type=int, default=24, help="greedy tokens per configuration (default 24)")
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    a = p.parse_args(argv)
    out = {}
    try:
        for model, kw in configs(a.moe, a.budget, a.moe_budget):
            with mlx_flash.load(model, progress=False, **kw) as e:
                s0 = e.ffn.stats()
                tokens, logits = greedy(e, e.tokenizer.encode(PROMPT), a.tokens)
                s1 = e.ffn.stats()
                texts = [
                    e.generate(PROMPT, max_tokens=a.tokens, stop=STOP),
                    e.generate(PROMPT, max_tokens=a.tokens, temperature=0.8, top_p=0.95, seed=3),
                ]
                # the throughput mode compared on the dense model (a sparse FFN follows one sequence and
                # is refused there)
                dense = model is None and kw.get("ffn") != "sparse"
                batch = e.generate_batch(BATCH, max_tokens=a.tokens) if dense else None
            key = ("moe " if model else "dense ") + " ".join(f"{k}={v}" for k, v in kw.items())
            out[key] = {
                "tokens": tokens,
                "logits_sha256": hashlib.sha256(logits.astype(np.float32).tobytes()).hexdigest()[:16],
                "bytes_read": s1.bytes_read - s0.bytes_read,
                "reads": s1.reads - s0.reads,
                "texts": texts,
                "batch_texts": batch,
            }
            print(key, out[key]["bytes_read"], out[key]["reads"], out[key]["logits_sha256"], file=sys.stderr)
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = json.dumps(out, indent=1)
    if a.out:
        write_durably(a.out, [(text + "\n").encode()], OutputError)
    else:
        print(text)
    return 0
