"""The process planner: runtime floor, KV cache, work buffers and weights under one limit; a limit
that cannot work is refused with the minimum."""

import pytest

from mlx_flash.models.kv_coded_blocks import BlockFormat

from mlx_flash.errors import ConfigError, MemoryBudgetError
from mlx_flash.memory.limit import MemoryLimit
from mlx_flash.memory.process_plan import (
    FLOOR_JITTER,
    MIN_KV_TOKENS,
    MIN_WINDOW,
    RUNTIME_SLACK,
    ModelShape,
    kv_bytes_per_token,
    plan_process,
    plan_tiers,
    work_bytes,
)

LLAMA_7B = ModelShape.from_config(
    {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
    }
)
MB = 10**6


def test_shape_and_kv_of_a_7b():
    assert kv_bytes_per_token(LLAMA_7B) == 2 * 32 * 4096 * 4  # 1 MiB of float32 keys and values per token
    moe = ModelShape.from_config(
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 100,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        }
    )
    assert (moe.ffn_width, moe.kv_heads, moe.head_dim) == (64, 4, 16)


def test_split_adds_up_to_the_limit():
    plan = plan_process(MemoryLimit(2000 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB, readers=9 * MB)
    a = plan.account()
    parts = (
        a["runtime_floor"]
        + a["runtime_slack"]
        + a["kv_cache"]
        + a["work_buffers"]
        + a["reader_buffers"]
        + a["weights_budget"]
    )
    assert parts == 2000 * MB
    assert plan.weights_budget >= 1000 * MB
    assert plan.kv_tokens == 200 * MB // kv_bytes_per_token(LLAMA_7B)  # auto: 10% of the limit
    assert "memory: limit 2000.0 MB" in plan.line("x")


def test_refused_below_the_minimum_with_the_minimum():
    with pytest.raises(MemoryBudgetError, match=r"memory budget 1000\.0 MB is below the minimum [0-9.]+ MB .*runtime"):
        plan_process(MemoryLimit(1000 * MB, "given"), 100 * MB, "torch", LLAMA_7B, 4096, 900 * MB)


def test_tight_limit_shrinks_kv_then_prefill_chunk_before_refusing():
    floor, weights = 100 * MB, 1500 * MB
    plan = plan_process(MemoryLimit(1900 * MB, "given"), floor, "mlx", LLAMA_7B, 4096, weights)
    # the auto KV target (10% of the limit: 181 tokens) comes down to its minimum, prefill chunks halve
    assert (plan.kv_tokens, plan.prefill_chunk) == (MIN_KV_TOKENS, 256)
    assert plan.weights_budget >= weights and "prefill chunk 512 -> 256" in plan.line("x")
    total = floor + RUNTIME_SLACK["mlx"] + plan.kv_bytes + work_bytes(LLAMA_7B, plan.prefill_chunk, plan.kv_tokens)
    assert total + plan.weights_budget == 1900 * MB


def test_explicit_context_is_planned_or_refused():
    plan = plan_process(MemoryLimit(4000 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB, context=300)
    assert plan.kv_tokens == 300
    with pytest.raises(ConfigError, match="more than the model's 4096 tokens"):
        plan_process(MemoryLimit(4000 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB, context=5000)
    with pytest.raises(ConfigError, match="below the minimum"):
        plan_process(MemoryLimit(2000 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB, context=2048)


def test_a_limit_the_process_would_pass_before_planning_is_refused_before_the_import(monkeypatch, tmp_path):
    import sys

    from mlx_flash.memory import process_plan
    from mlx_flash.memory.process_plan import BACKEND_IMPORT, BEFORE_PLAN, check_backend_room

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    cost = 230 * MB  # what the child measures on this imagined machine (more than the estimate)
    monkeypatch.setattr(process_plan, "measured_import_cost", lambda module, estimate, cache, backend: cost)
    before = 300 * MB - cost - BEFORE_PLAN  # RSS now: 300 MB once torch and a tokenizer are in
    # (the refusal names it with FLOOR_JITTER, rounded up: 302.1 MB)
    with pytest.raises(
        ConfigError,
        match=r"below the 302\.1 MB this process reaches on torch before it can plan"
        r".*measured here: 230\.0 MB for torch",
    ):
        check_backend_room(MemoryLimit(299 * MB, "given"), "torch", before, str(tmp_path))
    check_backend_room(MemoryLimit(300 * MB, "given"), "torch", before, str(tmp_path))
    # far above it the estimate is enough: nothing is measured
    monkeypatch.setattr(process_plan, "measured_import_cost", lambda *a: pytest.fail("measured"))
    check_backend_room(MemoryLimit(300 * MB + 3 * BACKEND_IMPORT["torch"][1], "given"), "torch", before, str(tmp_path))


def _named_minimum(limit: int, floor: int) -> int | None:
    import re

    try:
        plan_process(MemoryLimit(limit, "given"), floor, "mlx", LLAMA_7B, 4096, 1000 * MB)
    except MemoryBudgetError as e:
        return int(float(re.search(r"below the minimum ([0-9.]+) MB", str(e)).group(1)) * MB)
    return None


def test_the_named_minimum_is_one_number_and_a_limit_at_it_is_planned():
    # the same minimum whichever limit was refused (it once grew with the limit's auto KV target)
    named = {_named_minimum(n * MB, 100 * MB) for n in (10, 500, 1000, 1190)}
    assert len(named) == 1 and None not in named, named
    minimum = named.pop()
    # planned at that number, with the floor a little higher in the new process (FLOOR_JITTER)
    plan = plan_process(MemoryLimit(minimum, "given"), 100 * MB + FLOOR_JITTER, "mlx", LLAMA_7B, 4096, 1000 * MB)
    assert plan.weights_budget >= 1000 * MB and plan.kv_tokens == MIN_KV_TOKENS
    a = plan.account()
    assert a["runtime_floor"] + a["runtime_slack"] + a["kv_cache"] + a["work_buffers"] + a["weights_budget"] == minimum
    assert _named_minimum(minimum - 3 * MB, 100 * MB) == minimum  # and a limit just below is refused naming it


def test_a_7b_in_2_gb_holds_its_whole_context_with_the_older_kv_on_flash():
    """Its KV share holds 190 tokens; with tiers the plan's context is the model's 4096: the window
    resident, two read buffers of a layer's context, chunks small enough for attention over it, and
    all of it within the limit above the weights' minimum."""
    limit, floor, weights = MemoryLimit(2000 * MB, "given"), 100 * MB, 1000 * MB
    plan = plan_process(limit, floor, "mlx", LLAMA_7B, 4096, weights)
    assert plan.context == plan.kv_tokens == 190
    tiered = plan_tiers(plan, LLAMA_7B, 4096, weights, disk_free=10**12)
    assert tiered.context == 4096 and tiered.kv_tokens >= tiered.prefill_chunk + MIN_WINDOW
    assert tiered.tier_reads == 2 * 2 * 32 * 128 * 4096 * 4  # two buffers of one layer's keys and values
    assert tiered.tier_disk == 4096 * kv_bytes_per_token(LLAMA_7B)
    a = tiered.account()
    parts = a["runtime_floor"] + a["runtime_slack"] + a["kv_cache"] + a["work_buffers"] + a["kv_read_buffers"]
    assert parts + a["weights_budget"] == limit.bytes and a["weights_budget"] >= weights
    assert a["work_buffers"] == work_bytes(LLAMA_7B, tiered.prefill_chunk, 4096)
    assert f"{tiered.kv_tokens} tokens resident, " in tiered.line("x")
    assert "of read buffers for a 4096-token context, the older tokens on flash: 4295.0 MB of disk" in tiered.line("x")


def test_compressed_tiers_plan_their_read_buffers_and_disk_at_their_width():
    """4-bit blocks (models/kv_coded_blocks.py): a token's bytes on flash and in a read buffer are the
    blocks', about a seventh of float32's, and what the buffers no longer take goes to the weights."""
    limit, floor, weights = MemoryLimit(2000 * MB, "given"), 100 * MB, 1000 * MB
    plan = plan_process(limit, floor, "mlx", LLAMA_7B, 4096, weights)
    fmt = BlockFormat(4, 32, 128, 64)
    on_flash = fmt.bytes_per_token() * 32
    exact = plan_tiers(plan, LLAMA_7B, 4096, weights, disk_free=10**12)
    coded = plan_tiers(plan, LLAMA_7B, 4096, weights, 10**12, True, on_flash, 4)
    assert coded.tier_disk == 32 * 64 * fmt.nbytes  # 32 layers of 64 blocks
    assert coded.tier_reads == 2 * 64 * fmt.nbytes and coded.tier_reads * 6 < exact.tier_reads
    assert coded.weights_budget - exact.weights_budget == exact.tier_reads - coded.tier_reads
    assert "the older tokens on flash at 4 bits: 637.5 MB of disk" in coded.line("x")


def test_tiers_are_left_out_where_the_share_holds_the_context_or_nothing_fits():
    plan = plan_process(MemoryLimit(4000 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB, context=300)
    assert plan_tiers(plan, LLAMA_7B, 300, 1000 * MB, disk_free=10**12) is plan
    tight = plan_process(MemoryLimit(1300 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB)
    assert plan_tiers(tight, LLAMA_7B, 4096, 1000 * MB, disk_free=10**12) is tight


def test_a_context_the_disk_cannot_hold_is_refused_naming_both():
    plan = plan_process(MemoryLimit(2000 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB)
    with pytest.raises(ConfigError) as e:
        plan_tiers(plan, LLAMA_7B, 4096, 1000 * MB, disk_free=1000 * MB, folder="/flash/kv")
    assert str(e.value) == (
        "the KV tier folder /flash/kv has 1000.0 MB free, enough for 896 tokens (a context of 4096 needs "
        "4295.0 MB); free some, or lower --context"
    )


def test_without_context_asked_the_plan_holds_what_the_disk_holds_and_says_so():
    """1000 MB hold 953 tokens of a 7B's 1 MiB each: 896 in whole moves to flash (64 tokens), with the
    read buffers of that context; the plan names the folder, what is free, what it holds and what the
    model's context would need, in its line and its account (where the engine's refusal reads it)."""
    plan = plan_process(MemoryLimit(2000 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB)
    cut = plan_tiers(plan, LLAMA_7B, 4096, 1000 * MB, disk_free=1000 * MB, asked=False, folder="/flash/kv")
    assert cut.context == 896 and cut.tier_disk == 896 * kv_bytes_per_token(LLAMA_7B) <= 1000 * MB
    assert cut.tier_reads == 2 * 2 * 32 * 128 * 896 * 4
    words = "the KV tier folder /flash/kv has 1000.0 MB free, enough for 896 tokens (a context of 4096 needs 4295.0 MB)"
    assert cut.disk_short == cut.account()["kv_disk_short"] == words
    assert f"; context 896 tokens, not 4096: {words}" in cut.line("x")
    # with room on the disk nothing is said
    whole = plan_tiers(plan, LLAMA_7B, 4096, 1000 * MB, disk_free=10**12, asked=False, folder="/flash/kv")
    assert whole.context == 4096 and whole.disk_short == "" and "not 4096" not in whole.line("x")


def test_a_full_disk_leaves_the_context_memory_holds_and_says_so():
    """10 MB hold no move to flash: the context is the KV share's, resident, and the plan says why."""
    plan = plan_process(MemoryLimit(2000 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB)
    cut = plan_tiers(plan, LLAMA_7B, 4096, 1000 * MB, disk_free=10 * MB, asked=False, folder="/flash/kv")
    assert not cut.tier_context and cut.context == plan.kv_tokens < 4096
    assert cut.weights_budget == plan.weights_budget and cut.kv_bytes == plan.kv_bytes  # the plan as it was
    assert cut.disk_short == (
        f"the KV tier folder /flash/kv has 10.0 MB free, enough for {plan.kv_tokens} tokens "
        "(a context of 4096 needs 4295.0 MB)"
    )
    assert f"context {plan.kv_tokens} tokens, not 4096: the KV tier folder /flash/kv" in cut.line("x")


def test_a_compressed_file_cut_by_the_disk_fits_it_in_whole_blocks():
    """4-bit blocks of 64 tokens: the context the disk holds is whole blocks, so the file KVBlockFile
    reserves (every layer's blocks) is no more than what is free."""
    plan = plan_process(MemoryLimit(2000 * MB, "given"), 100 * MB, "mlx", LLAMA_7B, 4096, 1000 * MB)
    fmt = BlockFormat(4, 32, 128, 64)
    free = 100 * MB + 12345
    cut = plan_tiers(plan, LLAMA_7B, 4096, 1000 * MB, free, False, fmt.bytes_per_token() * 32, 4, "/flash/kv")
    assert cut.context % 64 == 0 and 32 * (cut.context // 64) * fmt.nbytes <= free
    assert 32 * (cut.context // 64 + 1) * fmt.nbytes > free  # and no block fewer than fits
    assert cut.disk_short.startswith(f"the KV tier folder /flash/kv has 100.0 MB free, enough for {cut.context} ")
