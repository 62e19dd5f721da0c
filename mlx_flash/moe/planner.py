"""The weights' share of the memory limit for a MoE model: non-expert weights (attention, embeddings, routers, shared
experts) stay resident as the backend holds them, and what is left holds expert slots. A slot keeps
one expert's bundle rows as stored (where reads land) and its weights as converted for compute (so a
cache hit costs no conversion). A budget that cannot hold the resident part plus one slot is
refused, naming the minimum."""

from __future__ import annotations

from ..errors import MemoryBudgetError
from ..units import fmt


def plan_experts(budget: int, resident: int, layout, converted_expert: int) -> tuple[int, dict]:
    """(slots, account) for `budget` bytes; slots never exceed the experts there are."""
    L, E, eb = len(layout.layer_offsets), layout.n_experts, layout.expert_nbytes
    slot = eb + converted_expert
    minimum = resident + slot
    if budget < minimum:
        raise MemoryBudgetError(
            f"weights budget {fmt(budget)} (what the memory budget leaves for weights, or "
            f"--weights-budget) is below the minimum {fmt(minimum)} for this MoE model "
            f"(non-expert weights {fmt(resident)}, one expert slot {fmt(slot)}: {fmt(eb)} as "
            f"stored and {fmt(converted_expert)} converted for compute)"
        )
    slots = min(L * E, (budget - resident) // slot)
    return slots, {
        "budget": budget,
        "resident_weights": resident,
        "converted_expert": converted_expert,
        "expert_slots": slots,
        "expert_bytes": eb,
        "slot_bytes": slot,
        "all_experts_bytes": L * E * slot,
        "planned_total": resident + slots * slot,
    }
