"""Batch generation throughput beside mlx-lm's, on the same weights and the same prompts: mlx-lm's
batch_generate (BatchGenerator) at batch 1 and at --batch, and its one-sequence stream_generate,
against our generate_batch on the MLX and torch backends with Policy(1, 1) and Policy(batch, 1).

    python -m mlx_flash.bench batch-peers [--mlx-lm-python /tmp/mlxlm-venv/bin/python] [--prompts 32]
        [--gen-tokens 32] [--batch 32] [--backends mlx,torch] [--runs 1] [--json OUT]

mlx-lm runs in a subprocess with another environment's python (--mlx-lm-python, or $MLX_LM_PYTHON;
its columns are skipped with a note when neither is given): mlx-lm pins transformers and torch
versions of its own, so it is kept out of this package's environment. Set that one up with

    python3.11 -m venv /tmp/mlxlm-venv && /tmp/mlxlm-venv/bin/pip install "mlx[cpu]" mlx-lm

mlx-lm reads a model directory built once from the GGUF (default: the package's
SmolLM2-135M-Instruct Q4_1) into <cache>/peers/ by mlx_flash/convert/mlx_lm_dir.py: config.json
from the GGUF metadata (llama; the GGUF keeps llama.cpp's q/k row order, so rope_traditional is
true, as our converter sets it), the Q4_1 blocks as mlx-lm's quantized layout (affine 4-bit, group
32: the same numbers, as mx.load reads them; the GGUF's 8-bit embedding as an 8-bit layer), scales,
biases and norms at --mlx-lm-dtype (float32 by default: MLX's CPU quantized_matmul is ~80x slower
on float16), and the tokenizer our converter builds from the GGUF. Before timing, both engines
greedy-complete --check-prompt and the tool compares the tokens.

Prompts: --prompts pieces of the Wikipedia corpus (tools/fetch_data.py), ~100-128 tokens each,
raw completions; mlx-lm gets the token ids our tokenizer makes of them. Each engine and batch size
runs once as warm-up (short prompts, 2 tokens), then --runs times; the median is reported. Decode
tok/s: generated tokens / decode seconds; end to end: generated tokens / the run's seconds (ours:
prefill + decode; mlx-lm: its BatchStats wall time, prefill, decode and the loop between), model
loading and our policy's calibration run excluded. Both stop a sequence at EOS: the table gives the
tokens generated. The load average is printed: on a shared machine the rates move with it.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import mlx_flash
from mlx_flash.calibrate import read_corpus
from mlx_flash.bench.batch_peers import corpus_prompts, rate, run_ours
from mlx_flash.config import default_cache_dir
from mlx_flash.convert.mlx_lm_dir import build_peer_dir
from mlx_flash.default_model import default_model_path
from mlx_flash.errors import FlashError, first_paragraph
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError

# Runs under --mlx-lm-python: argv[1] a request JSON, argv[2] where to write the results JSON.
PEER_WORKER = r"""
import json, statistics, sys, time
import mlx.core as mx
import mlx_lm
from mlx_lm import load, stream_generate
from mlx_lm.generate import batch_generate

req = json.load(open(sys.argv[1]))
model, tok = load(req["model_dir"])
out = {"mlx_lm": mlx_lm.__version__, "mlx": mx.__version__, "device": str(mx.default_device()),
       "eos_token_ids": sorted(tok.eos_token_ids), "rows": []}
out["check_ids"] = [r.token for r in stream_generate(model, tok, req["check_ids"], max_tokens=req["check_tokens"])]
prompts, n = req["prompts"], req["max_tokens"]


def batch_run(b, prompts, n):
    pb = min(b, req["prefill_batch"] or b)
    t0 = time.perf_counter()
    r = batch_generate(model, tok, prompts, max_tokens=n, completion_batch_size=b, prefill_batch_size=pb,
                       return_token_ids=True)
    wall = time.perf_counter() - t0
    s = r.stats
    return {"generated_tokens": s.generation_tokens, "prompt_tokens": s.prompt_tokens, "prefill_s": s.prompt_time,
            "decode_s": s.decode_time, "seconds": s.wall_time, "outer_s": wall, "steps": s.generation_steps,
            "peak_memory_gb": s.peak_memory}, r.token_ids


def sequential_run(prompts, n):
    pre = dec = gen = ptok = 0.0
    ids = []
    t0 = time.perf_counter()
    for p in prompts:
        toks, last = [], None
        for last in stream_generate(model, tok, p, max_tokens=n):
            toks.append(last.token)
        # stream_generate reports rates; its prompt time ends at the first token, its generation
        # time runs from there to the last token
        pre += last.prompt_tokens / last.prompt_tps
        dec += last.generation_tokens / last.generation_tps
        gen += last.generation_tokens
        ptok += last.prompt_tokens
        if toks and toks[-1] in tok.eos_token_ids:
            toks.pop()
        ids.append(toks)
    wall = time.perf_counter() - t0
    return {"generated_tokens": int(gen), "prompt_tokens": int(ptok), "prefill_s": pre, "decode_s": dec,
            "seconds": pre + dec, "outer_s": wall}, ids


def median_row(runs):
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    row["runs"] = len(runs)
    return row


for b in req["batches"]:
    batch_run(b, [x[:16] for x in prompts[:b]], 2)  # warm-up, on short prompts
    print(f"mlx-lm batch_generate batch {b}: warm", file=sys.stderr, flush=True)
    runs = []
    for _ in range(req["runs"]):
        row, ids = batch_run(b, prompts, n)
        runs.append(row)
    row = median_row(runs)
    row.update(engine="mlx-lm batch_generate", batch=b, token_ids=ids)
    out["rows"].append(row)
    print(f"mlx-lm batch_generate batch {b}: done in {row['outer_s']:.1f} s", file=sys.stderr, flush=True)
if req["sequential"]:
    sequential_run([prompts[0][:16]], 2)
    runs = []
    for _ in range(req["runs"]):
        row, ids = sequential_run(prompts, n)
        runs.append(row)
    row = median_row(runs)
    row.update(engine="mlx-lm stream_generate", batch=1, token_ids=ids)
    out["rows"].append(row)
json.dump(out, open(sys.argv[2], "w"))
"""


def run_mlx_lm(
    python: str,
    model_dir: str,
    prompt_ids: list,
    gen: int,
    batches: list[int],
    runs: int,
    check_ids: list,
    check_tokens: int,
    prefill_batch: int,
    sequential: bool,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        req, res = os.path.join(tmp, "req.json"), os.path.join(tmp, "res.json")
        write_json(
            req,
            {
                "model_dir": model_dir,
                "prompts": prompt_ids,
                "max_tokens": gen,
                "batches": batches,
                "runs": runs,
                "check_ids": check_ids,
                "check_tokens": check_tokens,
                "prefill_batch": prefill_batch,
                "sequential": sequential,
            },
            OutputError,
            indent=None,
        )
        r = subprocess.run([python, "-c", PEER_WORKER, req, res], stdout=sys.stderr)  # its output shows as it runs
        if r.returncode != 0:
            raise FlashError(f"mlx-lm under {python} failed (exit {r.returncode}; its output is above)")
        with open(res) as fh:
            return json.load(fh)


def print_table(rows: list[dict], batch: int) -> None:
    print("| engine | batch | tokens generated | prefill s | decode s | decode tok/s | end-to-end tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['batch']} | {r['generated_tokens']} | {r['prefill_s']:.2f} | "
            f"{r['decode_s']:.2f} | {rate(r, 'decode_s'):.1f} | {rate(r, 'seconds'):.1f} |"
        )
    print()
    by = {(r["engine"], r["batch"]): r for r in rows}
    for eng in dict.fromkeys(r["engine"] for r in rows):
        one, big = by.get((eng, 1)), by.get((eng, batch))
        if one and big and batch != 1:
            print(
                f"{eng}: batch {batch} / batch 1 = {rate(big, 'decode_s') / rate(one, 'decode_s'):.2f}x decode, "
                f"{rate(big, 'seconds') / rate(one, 'seconds'):.2f}x end to end"
            )
    peer = by.get(("mlx-lm batch_generate", batch))
    if peer:
        for eng in dict.fromkeys(r["engine"] for r in rows if r["engine"].startswith("ours")):
            if (eng, batch) in by:
                r = by[(eng, batch)]
                print(
                    f"{eng} / mlx-lm at batch {batch} = {rate(r, 'decode_s') / rate(peer, 'decode_s'):.2f}x decode, "
                    f"{rate(r, 'seconds') / rate(peer, 'seconds'):.2f}x end to end"
                )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench batch-peers", description=first_paragraph(__doc__))
    p.add_argument(
        "--model", default=None, help="a llama GGUF of Q4_0 / Q4_1 / Q8_0 weights (default: the package's SmolLM2 Q4_1)"
    )
    p.add_argument(
        "--mlx-lm-python",
        default=os.environ.get("MLX_LM_PYTHON"),
        help="python of an environment with mlx-lm (default: $MLX_LM_PYTHON; none: mlx-lm is skipped)",
    )
    p.add_argument(
        "--mlx-lm-dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="dtype of mlx-lm's scales, biases and norms, so of its activations (default: float32, "
        "as our MLX backend computes on the CPU; float16 is the GGUF's own, and MLX's CPU "
        "quantized_matmul runs it ~80x slower)",
    )
    p.add_argument(
        "--mlx-lm-prefill-batch",
        type=int,
        default=0,
        help="prompts mlx-lm prefills together (default 0: the batch size; mlx-lm's own default is 8)",
    )
    p.add_argument("--no-sequential", action="store_true", help="skip mlx-lm's one-sequence stream_generate row")
    p.add_argument("--backends", default="mlx,torch", help="our backends, comma list of mlx, torch")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", default="100-128", help="the prompts' token counts, LO-HI (default: 100-128)")
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="the large batch (the small one is 1)")
    p.add_argument("--runs", type=int, default=1, help="timed runs of each row after a warm-up; the median")
    p.add_argument("--check-prompt", default="The capital of France is")
    p.add_argument("--check-tokens", type=int, default=8)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    batches = sorted({1, a.batch})
    lo, _, hi = a.prompt_tokens.partition("-")
    if not (lo.isdigit() and (hi or lo).isdigit() and 0 < int(lo) <= int(hi or lo)):
        p.error(f"--prompt-tokens: LO-HI token counts, 0 < LO <= HI (got {a.prompt_tokens!r})")
    lo, hi = int(lo), int(hi or lo)
    if min(a.prompts, a.gen_tokens, a.batch, a.runs, a.check_tokens) < 1:
        p.error("--prompts, --gen-tokens, --batch, --runs and --check-tokens must be >= 1")
    backends = [b for b in a.backends.split(",") if b]
    rows, infos, notes, peer = [], {}, [], None
    load_before = os.getloadavg()
    try:
        if any(b not in ("mlx", "torch") for b in backends):
            raise FlashError(f"--backends: comma list of mlx, torch (got {a.backends!r})")
        with mlx_flash.load(a.model, backend="mlx", progress=False) as engine:
            tok = engine.tokenizer
            prompts = corpus_prompts(engine, read_corpus("wikipedia"), a.prompts, lo, hi)
            prompt_ids = [engine.encode_prompt(x) for x in prompts]
            check_prompt_ids = engine.encode_prompt(a.check_prompt)
        if not a.mlx_lm_python:
            notes.append("mlx-lm skipped: give --mlx-lm-python (or $MLX_LM_PYTHON), the python of a venv with mlx-lm")
        elif not os.path.isfile(a.mlx_lm_python):
            notes.append(f"mlx-lm skipped: {a.mlx_lm_python} does not exist")
        else:
            model_dir = build_peer_dir(a.model or default_model_path(), default_cache_dir(), a.mlx_lm_dtype)
            print(f"mlx-lm under {a.mlx_lm_python} on {model_dir}", file=sys.stderr, flush=True)
            peer = run_mlx_lm(
                a.mlx_lm_python,
                model_dir,
                prompt_ids,
                a.gen_tokens,
                batches,
                a.runs,
                check_prompt_ids,
                a.check_tokens,
                a.mlx_lm_prefill_batch,
                not a.no_sequential,
            )
            peer["model_dir"] = model_dir
            for r in peer["rows"]:
                r["texts"] = [tok.decode(t) for t in r.pop("token_ids")]
                print(
                    f"{r['engine']} batch {r['batch']}: {rate(r, 'decode_s'):.1f} decode tok/s, "
                    f"{rate(r, 'seconds'):.1f} end-to-end tok/s",
                    file=sys.stderr,
                    flush=True,
                )
            rows += peer["rows"]
        for backend in backends:
            r, info = run_ours(backend, prompts, a.gen_tokens, batches, a.runs, a.check_prompt, a.check_tokens, a.model)
            rows += r
            infos[backend] = info
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if peer:
        for backend, info in infos.items():
            same = peer["check_ids"] == info["check_ids"]
            notes.append(
                f"greedy {a.check_prompt!r}: ours {backend} {tok.decode(info['check_ids'])!r}, mlx-lm "
                f"{tok.decode(peer['check_ids'])!r}: {'same tokens' if same else 'DIFFERENT tokens'}"
            )
    big = {r["engine"]: r for r in rows if r["batch"] == a.batch}
    base = big.get("mlx-lm batch_generate") or big.get(f"ours {backends[0]}" if backends else "")
    if base:
        for r in rows:
            if "texts" in r and r is not base:
                same = sum(x == y for x, y in zip(r["texts"], base["texts"]))
                r["same_texts_as_" + base["engine"].replace(" ", "_") + f"_{a.batch}"] = same
                notes.append(
                    f"{r['engine']} batch {r['batch']}: {same}/{len(r['texts'])} completions identical to "
                    f"{base['engine']} batch {a.batch}'s"
                )
    load_after = os.getloadavg()
    plens = [len(x) for x in prompt_ids]
    print(
        f"\n{len(plens)} prompts of {min(plens)}-{max(plens)} tokens (Wikipedia), up to {a.gen_tokens} new tokens "
        f"each, greedy; median of {a.runs} run(s); {os.cpu_count()} cores, load average {load_before[0]:.1f} at "
        f"the start, {load_after[0]:.1f} at the end"
    )
    for backend, info in infos.items():
        if "describe" in info:
            print(f"ours {backend}: {info['describe']}")
    if peer:
        print(
            f"mlx-lm {peer['mlx_lm']} (mlx {peer['mlx']}, {peer['device']}), {a.mlx_lm_dtype} activations, "
            f"prefill batch {a.mlx_lm_prefill_batch or a.batch}"
        )
    print()
    print_table(rows, a.batch)
    for n in notes:
        print(f"note: {n}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        write_json(
            a.json,
            {
                "args": vars(a),
                "prompt_tokens": plens,
                "load_average": [load_before, load_after],
                "rows": rows,
                "notes": notes,
                "ours": {k: {"describe": v.get("describe"), "check_ids": v["check_ids"]} for k, v in infos.items()},
                "mlx_lm": {k: v for k, v in (peer or {}).items() if k != "rows"},
            },
            OutputError,
            indent=1,
        )
        print(f"wrote {a.json}")
    return 0
