"""Which layers each rank runs: contiguous ranges, planned from every rank's memory (exchanged at
start), so a rank with more room takes more layers. Rank 0 also holds the embeddings and the head
(it owns the tokenizer, sampling and the user-facing side), which come off its room first."""

from __future__ import annotations

from ..errors import ConfigError


def plan_stages(layer_bytes: list[int], rooms: list[int], rank0_fixed: int = 0) -> list[range]:
    """Layer ranges, one per rank, in rank order, covering every layer once: rank r's share of the
    layers' bytes follows its room (rank 0's less `rank0_fixed`); every rank gets at least one layer.
    Refused when there are fewer layers than ranks or a rank has no room."""
    n, size = len(layer_bytes), len(rooms)
    if size < 1 or n < size:
        raise ConfigError(f"a pipeline of {size} ranks needs at least {size} layers (the model has {n})")
    room = [max(int(r), 0) for r in rooms]
    room[0] = max(room[0] - int(rank0_fixed), 0)
    if min(room) <= 0:
        who = room.index(min(room))
        raise ConfigError(
            f"rank {who} has no memory left for layers ({rooms[who]} bytes"
            + (f", less {rank0_fixed} for the embeddings and head)" if who == 0 else ")")
        )
    total, whole = sum(layer_bytes), sum(room)
    bounds, start, acc, goal = [], 0, 0, 0.0
    for r in range(size - 1):
        goal += total * room[r] / whole
        end = start + 1  # at least one layer
        acc += layer_bytes[start]
        # take layers while the cumulative bytes stay nearer the goal, leaving one per later rank
        while end < n - (size - 1 - r) and abs(acc + layer_bytes[end] - goal) <= abs(acc - goal):
            acc += layer_bytes[end]
            end += 1
        bounds.append(range(start, end))
        start = end
    bounds.append(range(start, n))
    return bounds
