"""The tables of docs/results/sparsity.md, from the sparsity benchmark's records (python -m mlx_flash.bench
sparsity): quality per level against the dense model, and decode per level against the dense model in
the same run. Pure functions of the records, like result_tables.py."""

from __future__ import annotations

from .result_tables import MISSING, model_title, spread, table

WITHIN = 0.02  # the recommended level: the largest whose perplexity is within +2% of dense


def recommended(quality: dict) -> str | None:
    """The largest level of a model's quality part within +2% perplexity of its first (dense) level."""
    ppl = quality["perplexity"]
    base = next(iter(ppl.values()))
    ok = [float(k) for k, v in ppl.items() if v <= base * (1 + WITHIN)]
    return f"{max(ok):g}" if ok else None


def quality(rec: dict) -> str:
    rows = []
    for model, res in rec["quality"].items():
        ppl, base, best = res["perplexity"], next(iter(res["perplexity"].values())), recommended(res)
        n = len(next(iter(res["greedy"].values())))
        for level, value in ppl.items():
            mark = " (recommended)" if level == best and float(level) > 0 else ""
            rows.append(
                [
                    model_title(model),
                    f"{float(level):.0%}{mark}",
                    f"{value:.4f}",
                    f"{(value / base - 1) * 100:+.2f}%",
                    f"{res['equal'][level]} of {n}",
                    f"{res['shared_prefix'][level]:.1f}",
                ]
            )
    head = [
        "model",
        "sparsity",
        "perplexity, every row thresholded",
        "against dense",
        "greedy equal to dense",
        "tokens shared before the first difference (of 24)",
    ]
    return table(head, rows)


def predicted(st: dict) -> str:
    """The level's prediction of the bytes a token reads, and how far the measure is from it."""
    want = st.get("predicted_bytes_per_token")
    if not want:
        return MISSING
    return f"{want / 1e6:.1f}, {(st['read_bytes_per_token'] / want - 1) * 100:+.0f}%"


def decode(rec: dict, q: dict | None) -> str:
    """Each level's decode against dense (pairs), with the perplexity at that level where the quality
    record `q` has the model, the share of inputs zeroed and the bytes a token read against dense."""
    q = q or {}
    rows = []
    for model, by_backend in rec["decode"].items():
        ppl = (q.get("quality") or {}).get(model, {}).get("perplexity", {})
        base = next(iter(ppl.values()), None)
        for backend, levels in by_backend.items():
            peer = levels.get("dense_vs_llama.cpp")
            for level, res in levels.items():
                if level == "dense_vs_llama.cpp":
                    continue
                st = res["stats"]
                cost = MISSING if level not in ppl else f"{ppl[level]:.3f} ({(ppl[level] / base - 1) * 100:+.1f}%)"
                rows.append(
                    [
                        model_title(model),
                        "MLX" if backend == "mlx" else backend,
                        f"{float(level):.0%}",
                        cost,
                        spread([p["ours"] for p in res["pairs"]], 2),
                        spread([p["peer"] for p in res["pairs"]], 2),
                        f"**{res['median_ratio']:.2f}x** (lowest {res['lowest_ratio']:.2f}x)",
                        f"{st['zeroed_share']:.1%}",
                        f"{st['read_bytes_per_token'] / 1e6:.1f} ({predicted(st)}) / "
                        f"{st['dense_bytes_per_token'] / 1e6:.1f}",
                        MISSING if peer is None else f"{peer['peer_median']:.2f}",
                    ]
                )
    head = [
        "model",
        "backend",
        "sparsity",
        "perplexity (against dense)",
        "sparse, tok/s",
        "dense, tok/s",
        "sparse / dense, pairs",
        "inputs zeroed",
        "MB a token reads: sparse (predicted) / dense",
        "llama.cpp, tok/s",
    ]
    return table(head, rows)


def streamed_reads(rec: dict) -> str:
    """Per model, its dense engine's decode at the budget, then the streamed products' reads a token
    at its level (each layout and merge gap) against dense's, replayed by the reader pool: seconds, the
    bytes the drive counted (and what was asked), reads, and the tokens/s those reads alone allow
    against the dense engine's."""
    rows = []
    for model, res in rec["models"].items():
        reads, engine = res["reads"], res["dense_engine"]
        dense = reads["dense, one batch a token"]
        level = f"{res['level']:.0%} ({res['zeroed']:.1%} zeroed)"
        budget = engine["budget"].replace(":", " budget ")
        rows.append(
            [model_title(model), level, f"dense engine decoding, {budget}", MISSING, MISSING, MISSING]
            + [f"{1 / engine['tok_s']:.3f}", f"{engine['tok_s']:.3f} (measured)", "1.00x"]
        )
        for case, got in reads.items():
            off = (got["bytes_per_token"] / got["asked_per_token"] - 1) * 100
            rows.append(
                [
                    model_title(model),
                    level,
                    case,
                    f"{got['reads_per_token']:.0f}",
                    f"{got['bytes_per_token'] / 1e6:.1f} ({off:+.1f}%)",
                    f"{got['bytes_per_token'] / dense['bytes_per_token']:.2f}x",
                    f"{got['s_per_token']:.3f}",
                    f"{1 / got['s_per_token']:.3f}",
                    f"**{1 / got['s_per_token'] / engine['tok_s']:.2f}x**",
                ]
            )
    head = [
        "model",
        "sparsity",
        "reads",
        "reads a token",
        "MB the drive read a token (against asked)",
        "bytes against dense",
        "seconds a token",
        "tokens/s at most",
        "against the dense engine",
    ]
    return table(head, rows)


def group_quality(rec: dict) -> str:
    """What zeroing inputs by whole groups costs against single channels, every input at one level."""
    q = rec.get("quality")
    if not q:
        return table(["model", "sparsity", "dense", "single channels", "groups"], [])
    model, dense = q["model"], q["dense"]
    rows = []
    for level, ch in q["channels"].items():
        gr = q["groups"][level]
        rows.append(
            [
                model_title(model),
                f"{float(level):.0%}",
                f"{dense:.4f}",
                f"{ch:.4f} ({(ch / dense - 1) * 100:+.1f}%)",
                f"{gr:.4f} ({(gr / dense - 1) * 100:+.1f}%)",
            ]
        )
    head = [
        "model",
        "sparsity, every input",
        "perplexity, dense",
        "single channels zeroed",
        f"groups of {q['group']} zeroed",
    ]
    return table(head, rows)
