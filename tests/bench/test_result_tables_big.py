"""mlx_flash/bench/result_tables_big.py: the full tier's MoE and throughput tables from hand-written
records shaped like what `python -m mlx_flash.bench moe --json` and `throughput --json` write."""

from mlx_flash.bench.result_tables import NOT_BUILT
from mlx_flash.bench.result_tables_big import moe, throughput


def cells(text: str, row: int) -> list[str]:
    """The cells of the table's row (0: the first row under the header)."""
    return [c.strip() for c in text.splitlines()[2 + row].strip("|").split("|")]


def moe_record(peer: bool = True) -> dict:
    ours = {"ms": 144.5, "tok_s": 6.92, "mb_read": 106.24, "hit_rate": 0.475, "used_min": 0.539}
    ours.update(overlap_max=0.0833, top_max=0.375, engine="ours, mlx")
    resident = {"ms": 159.6, "tok_s": 6.26, "mb_read": 0.0, "hit_rate": None, "engine": "ours, torch"}
    rows = [ours, resident] + ([{"ms": 164.0, "tok_s": 6.1, "engine": "llama.cpp (mmap)"}] if peer else [])
    return {"commit": "abc", "rows": rows, "tokens": 16, "prompt_tokens": 64, "weights_budget": None, "model": "moe-8l"}


def test_moe_rows_and_ratio_to_the_peer():
    text = moe(moe_record())
    assert cells(text, 0) == ["ours, mlx", "144.5", "6.92", "**1.13x**", "106.2", "47.5%", "54%", "0.08"]
    # no routing recorded: "-"; a hit rate of None: every expert was held
    assert cells(text, 1) == ["ours, torch", "159.6", "6.26", "**1.03x**", "0.0", "all resident", "-", "-"]
    assert cells(text, 2) == ["llama.cpp (mmap)", "164.0", "6.10", "1.00x", "-", "-", "-", "-"]
    assert text.endswith(
        "16 teacher-forced tokens after a prompt of 64 (Wikipedia); model: the Qwen3-30B-A3B shape's first 8 of "
        "48 layers, Q4_1, synthetic weights; weights budget auto."
    )


def test_moe_without_the_peer_says_so():
    text = moe(moe_record(peer=False))
    assert cells(text, 0)[3] == NOT_BUILT
    assert cells(text, 2) == ["llama.cpp (mmap)", NOT_BUILT, "-", "-", "-", "-", "-", "-"]


def throughput_record() -> dict:
    single = {"label": "single", "mode": "single", "sequences": 1, "tokens_per_s": 0.83, "decode_tokens_per_s": 0.93}
    single.update(bytes_read=86 * 2**30, seconds=38.5, peak_rss=1292 * 2**20, vs_single=1.0, tokens=[[1, 2]])
    policy = {"gpu_batch": 16, "num_batches": 2, "kv_on_flash": 1, "order": "zigzag"}
    zigzag = {
        "label": "flexgen",
        "mode": "flexgen",
        "sequences": 32,
        "tokens_per_s": 5.87,
        "decode_tokens_per_s": 18.15,
    }
    zigzag.update(bytes_read=86 * 2**30, seconds=174.5, predicted_s=172.8, policy=policy, vs_single=5.87 / 0.83)
    zigzag.update(cgroup_peak=1606 * 2**20, cgroup_limit=2400 * 10**6, oom_kills=0, same_as_single=True)
    row = {"label": "row", "mode": "row", "sequences": 32, "tokens_per_s": 5.13}  # no decode rate, no check
    failed = {"label": "naive", "mode": "naive", "error": "killed"}
    args = {"store": "mistral-12l", "prompt": 128, "generate": 32, "memory_budget": "2.4GB", "cgroup": True}
    args["weights_share"] = 0.3
    return {"label": None, "args": args, "rows": [single, zigzag, row, failed]}


def test_throughput_rows():
    text = throughput(throughput_record())
    assert cells(text, 0) == ["(a) one at a time", "1", "-", "0.83", "0.93", "86.00", "1x", "-", "1292", "-"]
    assert cells(text, 1) == [
        "(c) zig-zag + searched policy",
        "32",
        "16 x 2, KV of 1 on flash",
        "5.87",
        "18.15",
        "86.00",
        "**7.1x**",
        "1.01x",
        "1606 (cgroup, 0 OOM)",
        "yes",
    ]
    assert cells(text, 2) == ["(b) batched, row order", "32", "-", "5.13", "-", "-", "-", "-", "-", "-"]
    assert cells(text, 3) == ["ablation: no policy search", "error: killed"] + ["-"] * 8
    assert text.endswith(
        "Store: the Mistral-7B layer shape, 12 of its 32 layers, Q8_0, synthetic weights; prompts of 128 tokens, "
        "32 generated each; memory budget 2.4GB "
        "(a cgroup), weights' budget 30% of the store."
    )


def test_the_same_record_gives_the_same_text():
    assert throughput(throughput_record()) == throughput(throughput_record())
    assert moe(moe_record()) == moe(moe_record())


def test_a_label_or_a_path_names_the_store():
    rec = throughput_record()
    assert "Store: `store-dir`;" in throughput({**rec, "args": {**rec["args"], "store": "<cache>/stores/store-dir"}})
    assert "Store: mine;" in throughput({**rec, "label": "mine"})
