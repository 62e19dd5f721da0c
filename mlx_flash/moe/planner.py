"""The memory budget of a MoE model: non-expert weights (attention, embeddings, routers, shared
experts) stay resident as the backend holds them, one expert's weights are converted for compute at
a time, and what is left holds expert slots (bundle rows as stored). A budget that cannot hold the
resident part plus one expert is refused, naming the minimum."""

from __future__ import annotations

from ..errors import ConfigError
from ..sparse.planner import fmt


def plan_experts(budget: int, resident: int, layout, converted_expert: int) -> tuple[int, dict]:
    """(slots, account) for `budget` bytes; slots never exceed the experts there are."""
    L, E, eb = len(layout.layer_offsets), layout.n_experts, layout.expert_nbytes
    fixed = resident + converted_expert
    minimum = fixed + eb
    if budget < minimum:
        raise ConfigError(f"memory budget {fmt(budget)} is below the minimum {fmt(minimum)} for this MoE model "
                          f"(non-expert weights {fmt(resident)}, one expert converted for compute "
                          f"{fmt(converted_expert)}, one expert slot {fmt(eb)})")
    slots = min(L * E, (budget - fixed) // eb)
    return slots, {"budget": budget, "resident_weights": resident, "converted_expert": converted_expert,
                   "expert_slots": slots, "expert_bytes": eb, "all_experts_bytes": L * E * eb,
                   "planned_total": fixed + slots * eb}
