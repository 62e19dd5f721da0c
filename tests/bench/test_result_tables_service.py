"""The service benchmarks' tables (mlx_flash/bench/result_tables_service.py) from small records of the
shape `python -m mlx_flash.bench service --json` and `... concurrency --json` write: LLMS against each
baseline per pattern with the ratio, per client count the repeats' median (lowest-highest) and the
ratio to one client; a field the run lacks is "-", and the same record gives the same text."""

import copy

from mlx_flash.bench import result_tables_service as ts


def cells(text: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines()[2:] if ln.startswith("|")]


def svc_row(variant, switch, ttft, pattern="random"):
    return {
        "variant": variant,
        "pattern": pattern,
        "calls": 16,
        "switch_mean_ms": switch,
        "switch_p50_ms": switch,
        "ttft_mean_ms": ttft,
        "chunks_read": 0,
        "chunks_recomputed": 0,
        "chunks_written": 0,
    }


SERVICE = {
    "commit": "0123456789",
    "dirty": False,
    "command": "python -m mlx_flash.bench service --patterns random",
    "config": {"contexts": 12, "context_tokens": 512, "calls": 16, "call_tokens": 32, "kv_share": 0.5},
    "model": "default",
    "backend": "torch",
    "rows": [
        svc_row("LLMS", 20.0, 200.0),
        svc_row("vLLM-S", 160.0, 350.0),
        svc_row("LMK", 1400.0, 1600.0),
        svc_row("LLMS w/o pipeline", 30.0, 210.0),
    ],
    "full_context": None,
}


def test_service_rows_are_each_baseline_against_llms_in_a_fixed_order():
    text = ts.service(SERVICE)
    rows = cells(text)
    assert [r[1] for r in rows] == ["LMK (drop, recompute)", "vLLM-S (chunks, LRU)", "LLMS w/o pipeline"]
    assert rows[0] == ["random", "LMK (drop, recompute)", "20.0", "1400.0", "**70.0x**", "200.0", "1600.0", "**8.0x**"]
    assert rows[1][4] == "**8.0x**" and rows[1][7] == "**1.8x**"
    assert "12 contexts of 512 tokens, 16 calls of 32 new tokens each, KV budget at least 50% of their KV" in text
    assert ts.service(copy.deepcopy(SERVICE)) == text


def test_service_without_llms_or_a_field_says_dash():
    rec = copy.deepcopy(SERVICE)
    rec["rows"] = [r for r in rec["rows"] if r["variant"] != "LLMS"]
    del rec["rows"][0]["ttft_mean_ms"]  # vLLM-S's
    rows = cells(ts.service(rec))
    assert rows[1] == ["random", "vLLM-S (chunks, LRU)", "-", "160.0", "-", "-", "-", "-"]
    assert rows[0][3] == "1400.0" and rows[0][6] == "1600.0"
    assert ts.service({"rows": []}).count("\n") == 1  # head only, no note without a config


def conc_row(clients, tps, per_client, ttft, identical):
    return {
        "clients": clients,
        "tokens": 32 * clients,
        "tokens_per_s": tps[0],
        "per_client_tokens_per_s": per_client[0],
        "ttft_median_ms": ttft[0],
        "identical": identical[0],
        "streams": clients,
        "repeats": [
            {"tokens_per_s": t, "per_client_tokens_per_s": p, "ttft_median_ms": f, "identical": i}
            for t, p, f, i in zip(tps, per_client, ttft, identical)
        ],
    }


CONCURRENCY = {
    "commit": "0123456789",
    "config": {"model": None, "backend": "torch", "max_tokens": 32, "memory_budget": "1.5GB", "repeat": 2},
    "reference_median_tokens_per_s": 30.25,
    "rows": [
        conc_row(16, [160.0, 200.0], [10.0, 12.0], [900.0, 1100.0], [16, 15]),
        conc_row(1, [28.0, 32.0], [28.0, 32.0], [40.0, 60.0], [1, 1]),
    ],
}


def test_concurrency_rows_show_the_repeats_spread_and_the_ratio_to_one_client():
    text = ts.concurrency(CONCURRENCY)
    rows = cells(text)
    assert [r[0] for r in rows] == ["1", "16"]
    assert rows[0] == ["1", "30.0 (28.0-32.0)", "30.0 (28.0-32.0)", "50 (40-60)", "1.0x", "2 of 2"]
    assert rows[1] == ["16", "180.0 (160.0-200.0)", "11.0 (10.0-12.0)", "1000 (900-1100)", "**6.0x**", "31 of 32"]
    assert "2 repeat(s)" in text and "30.2 tok/s" in text
    assert ts.concurrency(copy.deepcopy(CONCURRENCY)) == text


def test_concurrency_without_a_field_says_dash():
    rec = copy.deepcopy(CONCURRENCY)
    for r in rec["rows"]:
        r.pop("streams")
        for x in r["repeats"]:
            x.pop("per_client_tokens_per_s")
    rec["rows"] = [r for r in rec["rows"] if r["clients"] != 1]
    rows = cells(ts.concurrency(rec))
    assert rows == [["16", "180.0 (160.0-200.0)", "-", "1000 (900-1100)", "-", "-"]]
