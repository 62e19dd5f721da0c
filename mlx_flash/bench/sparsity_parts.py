"""The parts of the sparsity benchmark (python -m mlx_flash.bench sparsity): thresholds measured on
Austen, what each level costs on held-out Wikipedia text, and what it gains in decode speed against
the dense model in the same run. Each part returns its piece of the JSON record and says each figure
on stderr as it comes."""

from __future__ import annotations

import os
import sys
import time

from ..api import load
from ..calibrate.thresholds import measure
from ..errors import StoreError
from ..sparse.thresholds import load_thresholds, save_thresholds
from ..stats import sparsity_stats
from . import decode_pairs as dp
from . import quality as q

GREEDY_TOKENS = 24


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def thresholds_part(gguf: str, threads: int, tokens: int, allocate: int, again: bool) -> dict:
    """The model's thresholds: measured on `tokens` Austen tokens, shared among the inputs by the
    greedy search over `allocate` more (0: uniform), when the store has none (or `again`), else those
    it has. Returns how they were measured and how long it took."""
    with load(gguf, ffn="resident", threads=threads, progress=False) as e:
        if not again:
            try:
                found = load_thresholds(e.store, e.args.num_hidden_layers)
                say(f"  thresholds: kept ({found.calibration})")
                return {"measured": False, **found.calibration}
            except StoreError:
                pass
        t = time.perf_counter()
        found = measure(e, "austen", tokens, 512, allocate)
        save_thresholds(e.store, found)
        seconds = time.perf_counter() - t
    say(f"  thresholds: measured on {found.calibration} in {seconds:.1f} s")
    return {"measured": True, "seconds": seconds, **found.calibration, "allocation": found.allocation}


def prefix(a: list[int], b: list[int]) -> int:
    """Tokens two continuations share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def quality_part(gguf: str, levels, threads: int) -> dict:
    """Per level: perplexity over the first 4,096 Wikipedia tokens with every row thresholded, and the
    greedy continuations of 5 held-out prompts (prompt dense, each new token's step thresholded, as
    decode runs) against the dense model's."""
    out = {"perplexity": {}, "greedy": {}, "equal": {}, "shared_prefix": {}}
    dense = None
    for level in levels:
        key = f"{level:g}"
        with load(gguf, ffn="resident", threads=threads, sparsity=level, sparsity_rows="all", progress=False) as e:
            out["perplexity"][key] = q.engine_perplexity(e)["perplexity"]
        with load(gguf, ffn="resident", threads=threads, sparsity=level, progress=False) as e:
            runs = [q.greedy_tokens(e, p, GREEDY_TOKENS) for p in q.held_out_prompts(e.tokenizer)]
        dense = runs if dense is None else dense
        out["greedy"][key] = runs
        out["equal"][key] = sum(a == b for a, b in zip(runs, dense))
        out["shared_prefix"][key] = sum(prefix(a, b) for a, b in zip(runs, dense)) / len(runs)
        base = out["perplexity"][f"{levels[0]:g}"]
        say(
            f"  {level:.0%}: perplexity {out['perplexity'][key]:.4f} ({out['perplexity'][key] / base - 1:+.2%}), "
            f"greedy equal to dense {out['equal'][key]}/{len(runs)}, shared prefix {out['shared_prefix'][key]:.1f}"
        )
    return out


def decode_part(gguf: str, backends, levels, threads: int, pairs: int, gen: int, prompt: int, peer: bool) -> dict:
    """Per backend: the dense model's decode against llama.cpp's (with `peer`), then each level's
    against the dense model's, in interleaved pairs; the thresholded products' counters per token."""
    out = {}
    llm = dp.open_llama(gguf, prompt + gen + 16, threads) if peer else None
    for backend in backends:
        res = out[backend] = {}
        with load(gguf, backend=backend, ffn="resident", threads=threads, progress=False) as dense:
            ids = dense.tokenizer.encode(dp.prompt_text())[:prompt]

            def dense_run():
                return dp.engine_run(dense, ids, gen)

            if llm is not None:
                r = res["dense_vs_llama.cpp"] = dp.interleaved(dense_run, lambda: dp.llama_run(llm, ids, gen), pairs)
                say(f"  {backend} dense: {r['ours_median']:.2f} tok/s, llama.cpp {r['peer_median']:.2f}")
            for level in levels:
                with load(gguf, backend=backend, ffn="resident", threads=threads, sparsity=level, progress=False) as e:
                    r = res[f"{level:g}"] = dp.interleaved(lambda: dp.engine_run(e, ids, gen), dense_run, pairs)
                    st = sparsity_stats(e)
                    steps = st["rows"] / len(e.thresholded)  # each product runs one row a decode step
                    r["stats"] = st | {
                        "steps": steps,
                        "read_bytes_per_token": st["read_bytes"] / steps if steps else 0,
                        "dense_bytes_per_token": st["dense_bytes"] / steps if steps else 0,
                    }
                say(
                    f"  {backend} {level:.0%}: {r['ours_median']:.2f} tok/s against dense {r['peer_median']:.2f}: "
                    f"median pair {r['median_ratio']:.2f}x, lowest {r['lowest_ratio']:.2f}x; inputs zeroed "
                    f"{st['zeroed_share']:.1%}, bytes skipped {st['skipped_share']:.1%}"
                )
    return out


def model_label(name: str, gguf: str) -> str:
    """How a record names the model: its benchmark name, or a given file's base name."""
    return name if name != gguf else os.path.basename(gguf)
