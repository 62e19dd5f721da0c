"""The parts of the arithmetic benchmark (python -m mlx_flash.bench arithmetic): each measures one model in each
backend and arithmetic and returns its piece of the JSON record, saying each figure on stderr as it
comes (quality, decode, prompt, rows, profile, throughput; kernels and tmac are
arithmetic_kernels.arithmetic_table and tmac.tmac_against_q8)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..api import load

from . import decode_pairs as dp
from . import quality as q
from .batch_passes import decode_step
from .prompt_split import prefill_split
from .step_profile import step_profile
from .throughput import BenchConfig, against_single, run_config


@dataclass(frozen=True)
class PartOptions:
    threads: int
    pairs: int = 5  # interleaved decode pairs
    gen_tokens: int = 128
    decode_prompt: int = 128  # tokens of the decode part's prompt
    stream_gb: float = 0  # decode: also a read-only stream over this many GB
    prompt_tokens: int = 2000


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def against(res: dict, unit: str, tokens: int = 0) -> str:
    """The peer's side of a progress line: its median (tokens/s, or seconds for `tokens` tokens) and
    the pair ratios, or that llama.cpp is not built."""
    if res["peer_median"] is None:
        return "(llama.cpp: peer not built)"
    peer = tokens / res["peer_median"] if tokens else res["peer_median"]
    return (
        f"against llama.cpp {peer:.{2 if tokens else 1}f} {unit}: median pair {res['median_ratio']:.2f}x, "
        f"lowest {res['lowest_ratio']:.2f}x"
    )


def quality_part(gguf: str, arithmetics, threads: int) -> dict:
    out, runs = {"perplexity": {}}, {}
    for arith in arithmetics:
        with load(gguf, backend="torch", arithmetic=arith, threads=threads, progress=False) as e:
            out["perplexity"][arith] = q.engine_perplexity(e)["perplexity"]
            ids = e.tokenizer.encode(q.wikipedia(4096 * 12))[:4096]
            prompts = q.held_out_prompts(e.tokenizer)
            runs[arith] = [q.greedy_tokens(e, p, 24) for p in prompts]
        say(f"  {arith}: perplexity {out['perplexity'][arith]:.4f}")
    llm = dp.open_llama(gguf, 512, threads)
    if llm is not None:
        out["perplexity"]["llama.cpp"] = q.llama_perplexity(gguf, ids, threads)
        runs["llama.cpp"] = [q.llama_greedy(llm, p, 24) for p in prompts]
    runs["transformers"] = q.transformers_greedy(gguf, prompts, 24)
    out["greedy"] = runs
    out["agreement"] = q.agreement(runs, ["transformers", "llama.cpp", "exact"])
    return out


def engines(gguf, backends, arithmetics, threads):
    """("backend-arithmetic", engine) for each backend and arithmetic, one engine open at a time."""
    for backend in backends:
        for arith in arithmetics:
            with load(gguf, backend=backend, arithmetic=arith, threads=threads, progress=False) as e:
                yield f"{backend}-{arith}", e


def decode_part(gguf, backends, arithmetics, a: PartOptions) -> dict:
    llm, out = dp.open_llama(gguf, a.decode_prompt + a.gen_tokens + 16, a.threads), {}
    if a.stream_gb:
        out["read_stream_gbs"] = dp.read_stream_gbs(a.stream_gb, a.threads)
        out["token_bytes"] = dp.token_read_bytes(gguf)
        say(f"  a read-only stream over {a.stream_gb:g} GB: {out['read_stream_gbs']:.1f} GB/s")
    for name, e in engines(gguf, backends, arithmetics, a.threads):
        ids = e.tokenizer.encode(dp.prompt_text())[: a.decode_prompt]
        res = out[name] = dp.interleaved(
            lambda: dp.engine_run(e, ids, a.gen_tokens),
            None if llm is None else lambda: dp.llama_run(llm, ids, a.gen_tokens),
            a.pairs,
        )
        say(f"  {name}: decode {res['ours_median']:.1f} tok/s {against(res, 'tok/s')}")
    return out


def prompt_part(gguf, backends, arithmetics, a: PartOptions) -> dict:
    llm, out = dp.open_llama(gguf, a.prompt_tokens + 16, a.threads), {}
    text = dp.prompt_text(a.prompt_tokens * 12)
    for name, e in engines(gguf, backends, arithmetics, a.threads):
        ids = e.tokenizer.encode(text)[: a.prompt_tokens]
        peer = None if llm is None else lambda: dp.llama_run(llm, ids, 0)
        res = out[name] = dp.interleaved(lambda: dp.engine_run(e, ids, 0), peer, 3, key=0)
        s = res["split"] = prefill_split(e, ids)
        parts = (
            f" (linear {s['linear_s']:.2f} s, attention {s['attention_s']:.2f} s, rest {s['rest_s']:.2f} s)"
            if "linear_s" in s
            else ""
        )
        say(f"  {name}: {len(ids)}-token prompt {s['seconds']:.2f} s{parts}; {against(res, 's', len(ids))}")
    return out


def rows_part(gguf, backends, arithmetics, a: PartOptions) -> dict:
    out = {}
    for name, e in engines(gguf, backends, arithmetics, a.threads):
        one, sixteen = decode_step(e, 1), decode_step(e, 16)
        ratio = one.seconds * 16 / sixteen.seconds
        out[name] = {"one_s": one.seconds, "sixteen_s": sixteen.seconds, "ratio": ratio}
        say(f"  {name}: 16 rows {ratio:.2f}x one row's tokens/s")
    return out


def profile_part(gguf, backends, arithmetics, a: PartOptions) -> dict:
    out = {}
    for name, e in engines(gguf, ["torch"], arithmetics, a.threads):
        out[name] = [step_profile(e, rows) for rows in (1, 16)]
        for r in out[name]:
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["ops_ms"].items())[:4])
            say(f"  {name}: {r['rows']} rows {r['step_ms']:.1f} ms: {top}; Python {r['python_ms']:.2f}")
    return out


def throughput_part(gguf, backends, arithmetics, a: PartOptions) -> dict:
    text, out = q.wikipedia(400_000), {}
    for arith in arithmetics:
        base = dict(store=gguf, backend="torch", sequences=32, prompt=128, generate=32, ffn="stream", arithmetic=arith)
        rows = [run_config(BenchConfig(mode=mode, **base), text) | {"label": mode} for mode in ("single", "flexgen")]
        against_single(rows)
        batched = rows[1]
        out[arith] = {"single": rows[0], "flexgen": batched}
        say(
            f"  {arith}: 32 prompts, FFN streamed: {batched['tokens_per_s']:.1f} tok/s against "
            f"{rows[0]['tokens_per_s']:.2f} one at a time: {batched['tokens_per_s'] / rows[0]['tokens_per_s']:.1f}x; "
            f"first 4 equal to one at a time: {batched.get('same_as_single')}"
        )
    return out
