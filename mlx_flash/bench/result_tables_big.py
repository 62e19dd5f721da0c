"""The full tier's tables of the large synthetic shapes, each from one record: MoE decode fed by real
text beside llama.cpp (`python -m mlx_flash.bench moe --json`), and the throughput of a block of
sequences against one at a time (`python -m mlx_flash.bench throughput --json`). Pure functions of the
record, as in result_tables.py: "-" where a row lacks a field, "peer not built" where llama.cpp did
not run."""

from __future__ import annotations

from .result_tables import NOT_BUILT, cell, model_title, table

# the benchmark model names (bench/models.py) of this tier as a reader knows them
TITLES = {
    "moe-8l": "the Qwen3-30B-A3B shape's first 8 of 48 layers, Q4_1, synthetic weights",
    "mistral-12l": "the Mistral-7B layer shape, 12 of its 32 layers, Q8_0, synthetic weights",
}
THROUGHPUT_LABELS = {
    "single": "(a) one at a time",
    "row": "(b) batched, row order",
    "flexgen": "(c) zig-zag + searched policy",
    "compressed": "(d) (c) on the 4-bit store",
    "naive": "ablation: no policy search",
    "no-overlap": "ablation: (c) without overlap",
}


def _is_peer(row: dict) -> bool:
    return row.get("engine", "").startswith("llama.cpp")


def moe(rec: dict) -> str:
    """One row per engine: median ms a token and tokens/s, the ratio to llama.cpp's tokens/s in the
    same run, MB read a token, the expert cache's hit rate ("all resident" where every expert was
    held), and how the text routed (the smallest share of a layer's experts used, the largest overlap
    of consecutive steps' experts)."""
    peer = next((r for r in rec["rows"] if _is_peer(r) and r.get("tok_s")), None)
    rows = []
    for r in rec["rows"]:
        tok_s = r.get("tok_s")
        if _is_peer(r):
            x = "1.00x"
        elif peer is None:
            x = NOT_BUILT
        else:
            x = "-" if tok_s is None else f"**{tok_s / peer['tok_s']:.2f}x**"
        rows.append(
            [
                r.get("engine", "-"),
                cell(r.get("ms"), "{:.1f}"),
                cell(tok_s, "{:.2f}"),
                x,
                cell(r.get("mb_read"), "{:.1f}"),
                _hit(r),
                cell(r.get("used_min"), "{:.0%}"),
                cell(r.get("overlap_max"), "{:.2f}"),
            ]
        )
    if peer is None:
        rows.append(["llama.cpp (mmap)", NOT_BUILT, "-", "-", "-", "-", "-", "-"])
    head = [
        "engine",
        "ms/token",
        "tok/s",
        "x llama.cpp",
        "MB read/token",
        "expert hit rate",
        "experts used/layer (min)",
        "overlap (max)",
    ]
    budget = rec.get("weights_budget") or "auto"
    said = (
        f"\n\n{cell(rec.get('tokens'), '{}')} teacher-forced tokens after a prompt of "
        f"{cell(rec.get('prompt_tokens'), '{}')} (Wikipedia); model: {_title(rec.get('model'))}; "
        f"weights budget {budget}."
    )
    return table(head, rows) + said


def _hit(r: dict) -> str:
    """The expert cache's hit rate; "all resident" where the run held every expert (its rate is None)."""
    if "hit_rate" not in r:
        return "-"
    return "all resident" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"


def throughput(rec: dict) -> str:
    """One row per configuration: sequences, the policy's batch shape, generated tokens/s (prefill
    included) and decode's alone, the bytes read from the store, the ratio to one at a time, the
    measured time against the cost model's prediction, the peak memory (the cgroup's where the run
    had one, else the process's) and whether the batch's first sequences generated the tokens they
    did one at a time."""
    rows = []
    for r in rec["rows"]:
        label = THROUGHPUT_LABELS.get(r.get("label"), r.get("label", "-"))
        if "error" in r:
            rows.append([label, f"error: {r['error']}", *["-"] * 8])
            continue
        policy = r.get("policy")
        shape = "-"
        if isinstance(policy, dict) and "gpu_batch" in policy:
            shape = f"{policy['gpu_batch']} x {policy.get('num_batches', 1)}"
            if policy.get("kv_on_flash"):
                shape += f", KV of {policy['kv_on_flash']} on flash"
        pred = "-"
        if r.get("predicted_s") and r.get("seconds"):
            pred = f"{r['seconds'] / r['predicted_s']:.2f}x"
        same = r.get("same_as_single")
        rows.append(
            [
                label,
                cell(r.get("sequences"), "{}"),
                shape,
                cell(r.get("tokens_per_s"), "{:.2f}"),
                cell(r.get("decode_tokens_per_s"), "{:.2f}"),
                cell(r.get("bytes_read") and r["bytes_read"] / 2**30, "{:.2f}"),
                "1x" if r.get("label") == "single" else cell(r.get("vs_single"), "**{:.1f}x**"),
                pred,
                _peak(r),
                "-" if same is None else ("yes" if same else "**no**"),
            ]
        )
    head = [
        "configuration",
        "sequences",
        "policy (rows x micro-batches)",
        "tokens/s",
        "decode tokens/s",
        "read, GiB",
        "x one at a time",
        "measured / predicted",
        "peak, MiB",
        "same tokens as one at a time",
    ]
    args = rec.get("args") or {}
    said = (
        f"\n\nStore: {rec.get('label') or _title(args.get('store') or 'default')}; prompts of "
        f"{cell(args.get('prompt'), '{}')} tokens, {cell(args.get('generate'), '{}')} generated each; memory budget "
        f"{args.get('memory_budget', '-')}" + (" (a cgroup)" if args.get("cgroup") else "") + ", weights' budget "
        f"{cell(args.get('weights_share'), '{:.0%}')} of the store."
    )
    return table(head, rows) + said


def _title(name: str | None) -> str:
    if name is None:
        return "-"
    return TITLES.get(name) or f"`{model_title(name)}`"


def _peak(r: dict) -> str:
    if r.get("cgroup_peak"):
        return f"{r['cgroup_peak'] / 2**20:.0f} (cgroup, {r.get('oom_kills', 0)} OOM)"
    return "-" if r.get("peak_rss") is None else f"{r['peak_rss'] / 2**20:.0f}"
