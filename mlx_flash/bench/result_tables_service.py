"""The tables of the service benchmarks' records (`python -m mlx_flash.bench service` and
`python -m mlx_flash.bench concurrency`, each with --json), in the manner of result_tables.py: pure
functions of the record, so the same record always gives the same text; a field a run did not
record is "-"."""

from __future__ import annotations

import statistics

from .result_tables import MISSING, cell, model_title, spread, table

BASELINES = {
    "LMK": "LMK (drop, recompute)",
    "whole-context swap": "whole-context swap",
    "vLLM-S": "vLLM-S (chunks, LRU)",
    "vLLM-SQ": "vLLM-SQ (+ static 8-bit)",
}


def _ms(v) -> str:
    """Milliseconds: two decimals under 10 ms (a switch that reads nothing is a fraction of one)."""
    return MISSING if v is None else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _ratio(num, den) -> str:
    if num is None or not den:
        return MISSING
    x = num / den
    return f"**{x:.0f}x**" if x >= 100 else f"**{x:.1f}x**"


def service(rec: dict) -> str:
    """Per access pattern, LLMS against each baseline (then each ablation the run had) on the same
    trace: mean context switching latency (a call's arrival until its context is ready to prefill the
    new tokens) and mean time to first token, each beside the other's, and the other's over LLMS's."""
    rows_in = rec.get("rows") or []
    patterns = list(dict.fromkeys(r.get("pattern") for r in rows_in))
    rows = []
    for pattern in patterns:
        mine = [r for r in rows_in if r.get("pattern") == pattern]
        llms = next((r for r in mine if r.get("variant") == "LLMS"), {})
        others = [r for name in BASELINES for r in mine if r.get("variant") == name]
        others += [r for r in mine if r.get("variant") not in BASELINES and r.get("variant") != "LLMS"]
        for r in others:
            rows.append(
                [
                    str(pattern),
                    BASELINES.get(r.get("variant"), str(r.get("variant"))),
                    _ms(llms.get("switch_mean_ms")),
                    _ms(r.get("switch_mean_ms")),
                    _ratio(r.get("switch_mean_ms"), llms.get("switch_mean_ms")),
                    _ms(llms.get("ttft_mean_ms")),
                    _ms(r.get("ttft_mean_ms")),
                    _ratio(r.get("ttft_mean_ms"), llms.get("ttft_mean_ms")),
                ]
            )
    head = [
        "pattern",
        "against",
        "LLMS switch, ms",
        "its switch, ms",
        "its / LLMS's",
        "LLMS TTFT, ms",
        "its TTFT, ms",
        "its / LLMS's",
    ]
    return table(head, rows) + _service_note(rec)


def _service_note(rec: dict) -> str:
    cfg = rec.get("config") or {}
    if not cfg:
        return ""
    share = cfg.get("kv_share")
    mb = next((r["kv_budget_mb"] for r in rec.get("rows", []) if r.get("kv_budget_mb")), None)
    budget = f"{mb:.1f} MB, " if mb else ""
    return (
        f"\n\n{model_title(rec.get('model', 'default'))}, {rec.get('backend', MISSING)}: "
        f"{cfg.get('contexts', MISSING)} contexts of {cfg.get('context_tokens', MISSING)} tokens, "
        f"{cfg.get('calls', MISSING)} calls of {cfg.get('call_tokens', MISSING)} new tokens each, "
        f"KV budget {budget}at least {MISSING if share is None else f'{share:.0%}'} of their KV "
        "(more where a compressing variant's float chunks need it: the same for every variant)."
    )


def _spread(values, digits: int = 1) -> str:
    vals = [v for v in values if v is not None]
    return spread(vals, digits) if vals else MISSING


def _repeats(row: dict, key: str) -> list:
    """Every repeat's value of key; a record without repeats gives the row's own value."""
    reps = row.get("repeats")
    return [x.get(key) for x in reps] if reps else [row.get(key)]


def concurrency(rec: dict) -> str:
    """Per number of clients streaming at once from one server: total generated tokens/s across them,
    each client's own tokens/s and its time to first token (the median client), each as the median of
    the repeats (lowest-highest); the total's median over one client's; and how many streams equal the
    text their prompt gets alone."""
    rows_in = sorted(rec.get("rows") or [], key=lambda r: r.get("clients", 0))
    one = next((r for r in rows_in if r.get("clients") == 1), None)
    one_med = _median(_repeats(one, "tokens_per_s")) if one else None
    rows = []
    for r in rows_in:
        tps = _repeats(r, "tokens_per_s")
        med = _median(tps)
        same = _repeats(r, "identical")
        streams = r.get("streams")
        matched = (
            MISSING if streams is None or any(x is None for x in same) else f"{sum(same)} of {streams * len(same)}"
        )
        rows.append(
            [
                str(r.get("clients", MISSING)),
                _spread(tps),
                _spread(_repeats(r, "per_client_tokens_per_s")),
                _spread(_repeats(r, "ttft_median_ms"), 0),
                _ratio(med, one_med) if r is not one else "1.0x",
                matched,
            ]
        )
    head = [
        "clients",
        "total tok/s",
        "a client's tok/s",
        "TTFT, ms (median client)",
        "total / 1 client's",
        "streams equal to their prompt alone",
    ]
    return table(head, rows) + _concurrency_note(rec, len(_repeats(one or {}, "tokens_per_s")))


def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _concurrency_note(rec: dict, repeats: int) -> str:
    cfg = rec.get("config") or {}
    if not cfg:
        return ""
    return (
        f"\n\n{model_title(cfg.get('model') or 'default')}, {cfg.get('backend', MISSING)}, "
        f"max_tokens {cfg.get('max_tokens', MISSING)}, greedy, --memory-budget {cfg.get('memory_budget', MISSING)}, "
        f"{cfg.get('repeat', repeats)} repeat(s) of each count, each on a fresh server; each prompt alone: "
        f"{cell(rec.get('reference_median_tokens_per_s'))} tok/s (median)."
    )
