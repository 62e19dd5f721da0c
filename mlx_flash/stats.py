"""Read-only views of a loaded engine: how the memory budget was split, and what the expert cache
did. Per-token timings and bytes are in `engine.last.steps` (TokenStats); these cover what lives
longer than one generation."""

from __future__ import annotations
from .errors import ConfigError


def memory_plan(engine) -> dict:
    """How the planner split `memory_budget`, in bytes as held in memory (a copy; empty when the FFN
    is resident or streamed whole, where no budget applies).

    Sparse FFN (ffn="sparse"): budget, model_bytes (what the fully resident model holds on this
    backend; "50%" is of this), resident_weights, predictors, layer_buffer, converted_layer,
    ffn_rows_per_layer, ffn_rows_bytes, window, planned_total.
    MoE with streamed experts: budget, model_bytes, resident_weights (non-expert weights),
    expert_slots, slot_bytes (one expert as stored plus converted for compute), expert_bytes,
    converted_expert, all_experts_bytes (every expert in a slot), planned_total."""
    return dict(engine.memory_plan)


def expert_cache_stats(engine) -> dict:
    """Expert-cache counters of a MoE engine with streamed experts, cumulative since load():
    {"policy", "slots", "hits", "misses", "hit_rate", "per_layer": [(hits, misses), ...]}.
    A hit is a routed expert already in the cache; a miss is read from flash. Take two snapshots
    and subtract to measure a stretch of decoding on its own."""

    st = engine.ffn.stats()
    if not st.expert_policy:
        raise ConfigError(
            "expert_cache_stats needs a MoE model loaded with ffn='stream' or 'sparse' (resident experts have no cache)"
        )
    per_layer = list(st.expert_hits)
    hits, misses = sum(h for h, _ in per_layer), sum(m for _, m in per_layer)
    return {
        "policy": engine.config.experts.policy.value,
        "slots": st.expert_slots,
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / max(1, hits + misses),
        "per_layer": per_layer,
    }
