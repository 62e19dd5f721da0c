"""The tables of the results pages, each written from one record (mlx_flash/bench/results.py says which
record and page). A table shows every repetition's spread beside its median and the peer measured in
the same run; where llama.cpp was not built its column says so. Pure functions of the record: the same
record always gives the same text, so regenerating a page changes only what a new run changed."""

from __future__ import annotations

import statistics

NOT_BUILT = "peer not built"
MISSING = "-"  # a figure the record does not hold
MODELS = {
    "default": "default (SmolLM2-135M Q4_1)",
    "gemma": "Gemma 3 270M Q4_K_M",
    "7b": "Llama-2-7B shape Q4_1 (synthetic)",
    "moe-8l": "Qwen3-30B-A3B shape, 8 layers, Q4_1 (synthetic)",
    "mistral-12l": "Mistral-7B shape, 12 layers, Q8_0 (synthetic)",
}


def model_title(name: str) -> str:
    """The record's model key as a reader knows it (a GGUF path keeps only its file name)."""
    return MODELS.get(name, name.rsplit("/", 1)[-1])


def cell(value, fmt: str = "{:.1f}") -> str:
    """A figure formatted, or MISSING where the record has none."""
    return MISSING if value is None else fmt.format(value)


def spread(values, digits: int = 1) -> str:
    """ "median (lowest-highest)" of the repetitions."""
    vals = [v for v in values if v is not None]
    if not vals:
        return NOT_BUILT
    med = statistics.median(vals)
    return f"{med:.{digits}f} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def ratio(res: dict) -> str:
    if res.get("median_ratio") is None:
        return NOT_BUILT
    return f"**{res['median_ratio']:.2f}x** (lowest {res['lowest_ratio']:.2f}x)"


def split_config(name: str) -> tuple[str, str]:
    backend, _, arith = name.partition("-")
    return ("MLX" if backend == "mlx" else backend), arith


def configs(part: dict):
    """(model, backend, arithmetic, result) of a part's per-model, per-config results, in record order."""
    for model, results in part.items():
        for name, res in results.items():
            if isinstance(res, dict):
                yield model, *split_config(name), res


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def decode(rec: dict) -> str:
    rows = []
    for model, backend, arith, res in configs(rec["decode"]):
        ours = [p["ours"] for p in res["pairs"]]
        peer = [p["peer"] for p in res["pairs"]]
        rows.append([model_title(model), backend, arith, spread(ours), spread(peer), ratio(res)])
    head = ["model", "backend", "arithmetic", "ours, tok/s", "llama.cpp, tok/s", "ours / llama.cpp, pairs"]
    return table(head, rows)


def stream_share(rec: dict) -> str:
    """Weight bytes read per second at the decode rate (the record's bytes a token reads, times tokens/s)
    against a plain read-only stream over memory in the same run."""
    rows = []
    for model, part in rec["decode"].items():
        stream, gb = part.get("read_stream_gbs"), part.get("token_bytes", 0) / 1e9
        if not stream or not gb:
            continue
        for name, res in part.items():
            if not isinstance(res, dict):
                continue
            backend, arith = split_config(name)
            ours = res["ours_median"] * gb
            peer = NOT_BUILT if res["peer_median"] is None else f"{res['peer_median'] * gb / stream:.0%}"
            rows.append(
                [
                    model_title(model),
                    f"{gb:.3f}",
                    f"{stream:.1f}",
                    backend,
                    arith,
                    f"{ours:.1f}",
                    f"**{ours / stream:.0%}**",
                    peer,
                ]
            )
    head = [
        "model",
        "GB a token",
        "stream, GB/s",
        "backend",
        "arithmetic",
        "ours, GB/s",
        "of the stream",
        "llama.cpp, of the stream",
    ]
    return table(head, rows)


def prompt(rec: dict) -> str:
    rows = []
    for model, backend, arith, res in configs(rec["prompt"]):
        s = res["split"]
        tokens = s["tokens"]
        peer = [tokens / p["peer"] for p in res["pairs"] if p["peer"]]
        # the split of one run under torch's profiler: the rest is that run's wall time less the other two
        # (the profiler's own cost lands in it; set against an unprofiled run it could come out below 0)
        rest = s.get("profiled_s", 0) - s.get("linear_s", 0) - s.get("attention_s", 0)
        parts = (
            f"{s['profiled_s']:.2f}: {s['linear_s']:.2f} / {s['attention_s']:.2f} / {rest:.2f}"
            if "linear_s" in s
            else "(torch only)"
        )
        rows.append(
            [
                model_title(model),
                str(tokens),
                backend,
                arith,
                spread([tokens / p["ours"] for p in res["pairs"]], 2),
                spread(peer, 2) if peer else NOT_BUILT,
                ratio(res),
                parts,
            ]
        )
    head = [
        "model",
        "tokens",
        "backend",
        "arithmetic",
        "ours, s",
        "llama.cpp, s",
        "speed ratio",
        "a profiled run, s: linear / attention / rest",
    ]
    return table(head, rows)


def rows_table(rec: dict) -> str:
    rows = [
        [model_title(m), b, a, f"{r['one_s'] * 1e3:.1f}", f"{r['sixteen_s'] * 1e3:.1f}", f"**{r['ratio']:.2f}x**"]
        for m, b, a, r in configs(rec["rows"])
    ]
    return table(["model", "backend", "arithmetic", "1 row, ms", "16 rows, ms", "16 rows' tokens/s / 1 row's"], rows)


def quality(rec: dict) -> str:
    rows = []
    for model, res in rec["quality"].items():
        ppl = res["perplexity"]
        exact = ppl["exact"]

        def cost(name):
            return NOT_BUILT if name not in ppl else f"{ppl[name]:.4f} ({(ppl[name] / exact - 1) * 100:+.2f}%)"

        agree = res["agreement"]

        def equal(run, ref):
            return str(agree.get(run, {}).get(ref, "-")) if run in agree and ref in agree else "-"

        n = len(res["greedy"]["exact"])
        rows.append(
            [
                model_title(model),
                f"{exact:.4f}",
                cost("q8"),
                cost("llama.cpp"),
                f"{equal('exact', 'transformers')} / {equal('q8', 'transformers')} / "
                f"{equal('llama.cpp', 'transformers')} of {n}",
                f"{equal('exact', 'llama.cpp')} / {equal('q8', 'llama.cpp')} of {n}",
            ]
        )
    head = [
        "model",
        "exact, perplexity",
        "q8 (against exact)",
        "llama.cpp (against exact)",
        "greedy equal to transformers': exact / q8 / llama.cpp",
        "equal to llama.cpp's: exact / q8",
    ]
    return table(head, rows)


def kernels(rec: dict) -> str:
    """The product alone: the default kernel path's rows (one per shape, rows and threads: GB/s of
    stored bytes), then each instruction-set level this CPU runs, one row and one thread, timed."""
    rows = []
    for r in rec["kernels"]:
        if r.get("level"):
            rows.append(
                [
                    r["shape"],
                    "",
                    str(r["rows"]),
                    str(r["threads"]),
                    r["level"],
                    f"{r['exact_ms']:.3f} ms",
                    f"{r['q8_ms']:.3f} ms",
                ]
                + [f"{r['exact_ms'] / r['q8_ms']:.2f}x"]
            )
            continue
        rows.append(
            [
                r["shape"],
                f"{r['N']}x{r['K']}",
                str(r["rows"]),
                str(r["threads"]),
                "the one dispatched",
                f"{r['exact_GBs']:.1f} GB/s",
                f"{r['q8_GBs']:.1f} GB/s",
                f"{r['q8_speedup']:.2f}x",
            ]
        )
    head = ["shape", "N x K", "rows", "threads", "code path", "exact", "q8", "q8's speed / exact's"]
    return table(head, rows)


def memory(rec: dict) -> str:
    """Engines inside a memory limit (mlx_flash.bench memory): outcome, decode rate, what a token read
    from the drive (the cgroup's I/O counters), the cgroup's peak and OOM kills."""
    rows = []
    for r in rec["rows"]:
        ok = r["outcome"] == "ok"
        rows.append(
            [
                f"{r['engine']} {r['mode']}",
                r["limit_label"],
                r["outcome"] if r.get("refused") is None else f"refused: {r['refused']}",
                f"**{r['decode_tps']:.3f}**" if ok else "-",
                f"{r['decode_read_per_token'] / 1e9:.2f}" if ok and r.get("decode_read_per_token") else "-",
                f"{r['peak_cgroup'] / 1e9:.2f}" if r.get("peak_cgroup") else "-",
                str(r.get("oom_kills", 0)),
            ]
        )
    head = ["engine", "limit", "outcome", "decode, tok/s", "read a token, GB", "cgroup peak, GB", "OOM kills"]
    return (
        table(head, rows)
        + f"\n\nModel: {rec.get('title', '')}; drive rate probed at {rec['bandwidth'] / 1e9:.2f} GB/s."
    )


def _pick(part: dict | None, model: str, name: str) -> dict | None:
    return None if part is None else part.get(model, {}).get(name)


def headline(recs: dict) -> str:
    """One row per claim the project leads with, each from its record (named in the stamps below)."""
    rows = []
    dec = recs["quick-decode"] and recs["quick-decode"]["decode"]
    for arith in ("exact", "q8"):
        cells = [(b, _pick(dec, "default", f"{b}-{arith}")) for b in ("torch", "mlx")]
        if all(r for _, r in cells):
            said = ", ".join(
                f"{split_config(b + '-')[0]} {r['ours_median']:.1f} tok/s against {_peer(r, '{:.1f}')} ({_x(r)})"
                for b, r in cells
            )
            label = "exact (`auto`)" if arith == "exact" else '`arithmetic="q8"`'
            rows.append([f"default model, decode, {label}", said, "[backends](backends.md)"])
    pro = recs["quick-prompt"] and recs["quick-prompt"]["prompt"]
    for arith in ("exact", "q8"):
        cells = [(b, _pick(pro, "default", f"{b}-{arith}")) for b in ("torch", "mlx")]
        if all(r for _, r in cells):
            n = cells[0][1]["split"]["tokens"]
            said = ", ".join(
                f"{split_config(b + '-')[0]} {n / r['ours_median']:.2f} s against {_peer(r, '{:.2f} s', n)} ({_x(r)})"
                for b, r in cells
            )
            rows.append([f"a {n}-token prompt, default model, {arith}", said, "[backends](backends.md)"])
    qual = recs["quick-quality"] and recs["quick-quality"]["quality"]
    for model in ("default", "gemma"):
        ppl = (qual or {}).get(model, {}).get("perplexity")
        if ppl and "q8" in ppl:
            peer = f"; llama.cpp {(ppl['llama.cpp'] / ppl['exact'] - 1) * 100:+.2f}%" if "llama.cpp" in ppl else ""
            rows.append(
                [
                    f"q8's perplexity cost, {model_title(model)}",
                    f"{(ppl['q8'] / ppl['exact'] - 1) * 100:+.2f}% against exact{peer}",
                    "[arithmetic](arithmetic.md)",
                ]
            )
    big = recs["full-7b-decode"] and recs["full-7b-decode"]["decode"]
    seven = next(iter(big.values())) if big else None
    cells = [(b, seven and seven.get(f"{b}-q8")) for b in ("torch", "mlx")]
    if all(r for _, r in cells):
        said = ", ".join(
            f"{split_config(b + '-')[0]} {r['ours_median']:.2f} tok/s against {_peer(r, '{:.2f}')} ({_x(r)})"
            for b, r in cells
        )
        rows.append(["Llama-2-7B shape Q4_1 (synthetic weights), resident, q8", said, "[backends](backends.md)"])
    mem = recs["full-7b-2gb"]
    if mem:
        said = ", ".join(
            f"{r['engine']} {r['mode']} " + (f"{r['decode_tps']:.3f} tok/s" if r["outcome"] == "ok" else r["outcome"])
            for r in mem["rows"]
        )
        rows.append(
            ["Llama-2-7B shape Q4_1 (synthetic weights) in a 2 GB cgroup", said, "[memory-limits](memory-limits.md)"]
        )
    return table(["what", "result (same run as its peer)", "page"], rows)


def _peer(res: dict, fmt: str, tokens: int = 0) -> str:
    if res["peer_median"] is None:
        return f"llama.cpp ({NOT_BUILT})"
    return "llama.cpp " + fmt.format(tokens / res["peer_median"] if tokens else res["peer_median"])


def _x(res: dict) -> str:
    return "-" if res["median_ratio"] is None else f"{res['median_ratio']:.2f}x"
