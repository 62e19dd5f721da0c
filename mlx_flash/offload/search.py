"""The policy search (FlexGen §4.3): for every (gpu_batch, num_batches) and KV width allowed, a
linear program over the share of the weights held in memory, then the best policy by the cost
model's tokens/s.

The enumeration also covers the KV of none, half or all of a block's micro-batches on flash (exact
KV only). The LP (scipy.optimize.linprog), per enumerated point, variables w (the share of each layer's FFN
bytes in memory), t_pre, t_dec (one layer's prefill and decode-step time):

    minimize   L x t_pre + L x G x t_dec
    subject to t_pre >= prefill compute,   t_pre >= (1 - w) x read + KV written   (sum without overlap)
               t_dec >= decode compute,    t_dec >= (1 - w) x read x reads per layer + KV read
               w x L x layer bytes + KV(block) + activations(block) <= room,   0 <= w <= 1

Placement is by whole layers, so w becomes floor(w x L) resident layers (the memory constraint still
holds), and the policy's prediction is the cost model's for that placement (cost_model.block_seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scipy.optimize import linprog

from ..errors import MemoryBudgetError
from ..units import fmt
from .cost_model import (
    Machine,
    Workload,
    block_seconds,
    fits,
    kv_flash_seconds,
    memory_bytes,
    minimum_bytes,
    run_seconds,
    tokens_per_s,
)
from .policy import Policy
from ..batching.schedule import Order

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Choice:
    policy: Policy
    tokens_per_s: float  # predicted, one full block
    seconds: float  # predicted for the whole workload
    memory: int  # bytes the policy holds at its peak


def resident_share(m: Machine, w: Workload, p: Policy) -> float | None:
    """The LP's w for p's batch shape (None: even w = 0 does not fit the room)."""
    L, G = m.n_layers, w.generate
    rd = m.ffn_layer_bytes / m.read_bps
    attn = sum(m.attn_read(i) for i in range(L)) / L / m.read_bps  # streamed attention, per layer on average
    mbs = -(-p.block_size // p.gpu_batch)
    reads = mbs if p.order is Order.ROW else 1
    pre_reads = p.block_size if p.order is Order.ROW else 1
    pre_c = p.block_size * m.compute.prefill(w.prompt)
    dec_c = mbs * m.compute.decode(p.gpu_batch)
    kv_pre, kv_dec = kv_flash_seconds(m, w, p)
    fixed = memory_bytes(m, w, replace(p, resident_layers=0))
    free = m.room - fixed
    if free < 0:
        return None
    # x = [w, t_pre, t_dec]; A_ub x <= b_ub
    # t >= (1 - w) rd n + attn n  <=>  -rd n w - t <= -(rd + attn) n ; without overlap compute adds in
    if p.overlap:
        A = [[0, -1, 0], [-rd * pre_reads, -1, 0], [0, 0, -1], [-rd * reads, 0, -1]]
        b = [-pre_c, -(rd + attn) * pre_reads - kv_pre, -dec_c, -(rd + attn) * reads - kv_dec]
    else:
        A = [[-rd * pre_reads, -1, 0], [-rd * reads, 0, -1]]
        b = [-pre_c - (rd + attn) * pre_reads - kv_pre, -dec_c - (rd + attn) * reads - kv_dec]
    A.append([L * m.ffn_layer_bytes, 0, 0])
    b.append(min(free, m.weights_room))
    res = linprog(c=[0, L, L * G], A_ub=A, b_ub=b, bounds=[(0, 1), (0, None), (0, None)], method="highs")
    if not res.success:
        return None
    return float(res.x[0])


def search(m: Machine, w: Workload, kv_bits=(0,), order: Order = Order.ZIGZAG, overlap: bool = True) -> Choice:
    """The best policy for the workload on this machine (see the module docstring); refuses a room
    that cannot hold one sequence with nothing resident, naming the minimum."""
    need = minimum_bytes(m, w)
    if m.room < need:
        raise MemoryBudgetError(
            f"the memory budget leaves {fmt(max(m.room, 0))} for the batch; one sequence needs "
            f"{fmt(need)} at the least (its KV cache and one layer's activations): raise "
            "memory_budget or shorten the prompts"
        )
    best: Choice | None = None
    for gb in SIZES:
        if gb > w.sequences:
            break
        for nb in SIZES:
            if gb * nb > w.sequences * 2 - 1 and nb > 1:  # no block much larger than the work
                break
            for bits, spilled in _kv_placements(kv_bits, nb):
                p = Policy(
                    gpu_batch=gb, num_batches=nb, kv_bits=bits, order=order, overlap=overlap, kv_on_flash=spilled
                )
                share = resident_share(m, w, p)
                if share is None:
                    continue
                p = replace(p, resident_layers=min(m.n_layers, int(share * m.n_layers + 1e-9)))
                while p.resident_layers and not fits(m, w, p):
                    p = replace(p, resident_layers=p.resident_layers - 1)
                c = Choice(p, tokens_per_s(m, w, p), run_seconds(m, w, p), memory_bytes(m, w, p))
                if best is None or c.seconds < best.seconds * 0.999:
                    best = c
    if best is None:
        raise MemoryBudgetError(f"no policy fits the {fmt(m.room)} the memory budget leaves for the batch")
    return best


def _kv_placements(kv_bits, num_batches: int):
    """(kv_bits, micro-batches on flash) to try: exact KV in memory, half or all of it on flash."""
    for bits in kv_bits:
        for spilled in sorted({0, num_batches // 2, num_batches}) if not bits else (0,):
            yield bits, spilled


def describe(m: Machine, w: Workload, p: Policy) -> Choice:
    """The cost model's view of a given policy (for --policy runs and ablations); refuses one that does
    not fit the room."""
    if not fits(m, w, p):
        raise MemoryBudgetError(
            f"policy {p} needs {fmt(memory_bytes(m, w, p))} ({fmt(p.resident_layers * m.ffn_layer_bytes)} "
            f"of resident layers); the memory budget leaves {fmt(max(m.room, 0))} "
            f"({fmt(max(m.weights_room, 0))} for weights)"
        )
    return Choice(p, tokens_per_s(m, w, p), run_seconds(m, w, p), memory_bytes(m, w, p))


__all__ = ["Choice", "block_seconds", "describe", "resident_share", "search"]
