"""Our side of `python -m mlx_flash.bench batch-peers`: Wikipedia prompts of stated lengths, and `generate_batch`
timed at each batch size (medians of its own prefill and decode seconds) with the texts it gave."""

from __future__ import annotations

import statistics
import sys
import time

from ..api import load
from ..errors import FlashError
from ..offload import Policy


def corpus_prompts(engine, text: str, count: int, lo: int, hi: int) -> list[str]:
    """`count` consecutive pieces of `text` (the Wikipedia corpus), the k-th cut to lo + (7k mod (hi - lo + 1))
    tokens (re-encoded text may differ by a token at the cut)."""
    ids = engine.tokenizer.encode(text[: 2000 * count], add_special_tokens=False)
    out, at = [], 0
    for k in range(count):
        n = lo + (7 * k) % (hi - lo + 1)
        if at + n > len(ids):
            raise FlashError(f"the corpus gave {len(ids)} tokens, too few for {count} prompts")
        out.append(engine.tokenizer.decode(ids[at : at + n]))
        at += n
    return out


def run_ours(
    backend: str,
    prompts: list[str],
    gen: int,
    batches: list[int],
    runs: int,
    check: str,
    check_tokens: int,
    model: str | None,
) -> tuple[list[dict], dict]:
    rows, info = [], {}
    with load(model, backend=backend, progress=False) as engine:
        info["describe"] = engine.ops.describe()
        info["check_ids"] = [s.token for s in engine.stream_generate(check, max_tokens=check_tokens)]
        for b in batches:
            policy = Policy(gpu_batch=b, num_batches=1)
            engine.generate_batch([x[:60] for x in prompts[:b]], max_tokens=2, policy=policy)  # warm-up, short
            results = []
            for _ in range(runs):
                t0 = time.perf_counter()
                texts = engine.generate_batch(prompts, max_tokens=gen, policy=policy)
                outer = time.perf_counter() - t0
                s = engine.last_batch
                results.append(
                    {
                        "generated_tokens": s.generated_tokens,
                        "prompt_tokens": s.prompt_tokens,
                        "prefill_s": s.prefill_s,
                        "decode_s": s.decode_s,
                        "seconds": s.seconds,
                        "outer_s": outer,
                    }
                )
            row = {k: statistics.median(r[k] for r in results) for k in results[0]}
            row.update(engine=f"ours {backend}", batch=b, runs=runs, policy=str(policy), texts=texts)
            rows.append(row)
            print(
                f"ours {backend} batch {b}: {rate(row, 'decode_s'):.1f} decode tok/s, "
                f"{rate(row, 'seconds'):.1f} end-to-end tok/s",
                file=sys.stderr,
                flush=True,
            )
    return rows, info


def rate(row: dict, key: str) -> float:
    return row["generated_tokens"] / row[key] if row.get(key) else float("nan")
