"""Expert-wise bit-width adaptation (EdgeMoE §6): which experts can live at a low width.

Offline, on calibration tokens, with every expert resident (torch, exact float32 compute):
  1. importance: quantize one expert alone to the low width (all others at the base width) and
     measure the mean token loss change; repeat for every expert;
  2. widths: the uniform widths around the tolerance P: `high` is the narrowest uniform width whose
     perplexity stays within (1 + P) of float16, `low` the next narrower one;
  3. greedy: the K least important experts go to `low`, the rest to `high`; K is the largest that
     keeps the perplexity within (1 + P) (binary search, each probe a real evaluation).
Experts are swapped in place as fake-quantized float weights (quantized, then dequantized: the
numbers a quantized expert computes with), so no store is written until the widths are chosen.
"""

from __future__ import annotations

import math

import numpy as np

from ..ffn_source import FFNWeights
from .mixed_store import expert_rows, fake_quantized
from .perplexity_eval import token_nlls

UNIFORM = (2, 4, 8)


class ExpertSwapper:
    """Sets the weights of a resident engine's experts from float rows; remembers the originals."""

    def __init__(self, engine, rows: list[list[dict]]):
        self.engine, self.rows = engine, rows
        self.layers = engine.ffn.layers  # ResidentExperts: [layer][expert] -> weights

    def weights(self, rows: dict) -> FFNWeights:
        ops = self.engine.ops
        gate_up = np.concatenate([rows["gate"], rows["up"]])
        return FFNWeights(
            gate_up=ops.weight({"weight": gate_up}, None),
            down=ops.weight({"weight": rows["down"]}, None, transposed=True),
        )

    def set(self, bits: list[list[int]], group_size: int = 32) -> None:
        for i, row in enumerate(bits):
            for e, b in enumerate(row):
                self.layers[i][e] = self.weights(fake_quantized(self.rows[i][e], b, group_size))


def mean_nll(engine, ids: list[int], context: int = 512) -> float:
    total, n = 0.0, 0
    for s in range(0, len(ids), context):
        w = ids[s : s + context]
        if len(w) < 2:
            continue
        logits = np.asarray(engine.forward(w, engine.new_caches(), all_logits=True), dtype=np.float32)
        nll = token_nlls(logits.reshape(len(w), -1)[:-1], np.asarray(w[1:]))
        total, n = total + float(nll.sum()), n + len(nll)
    return total / n


def importance(swapper: ExpertSwapper, ids: list[int], low: int, base: int, progress: bool = False) -> np.ndarray:
    """[L, E] loss change when expert (l, e) alone goes from `base` to `low` bits."""
    from tqdm import tqdm

    L, E = len(swapper.rows), len(swapper.rows[0])
    swapper.set([[base] * E for _ in range(L)])
    ref = mean_nll(swapper.engine, ids)
    out = np.zeros((L, E))
    with tqdm(total=L * E, desc=f"expert importance (INT{low} alone)", unit="expert", disable=not progress) as bar:
        for i in range(L):
            for e in range(E):
                keep = swapper.layers[i][e]
                swapper.layers[i][e] = swapper.weights(fake_quantized(swapper.rows[i][e], low))
                out[i, e] = mean_nll(swapper.engine, ids) - ref
                swapper.layers[i][e] = keep
                bar.update()
    return out


def perplexity_at(swapper: ExpertSwapper, ids: list[int], bits: list[list[int]]) -> float:
    swapper.set(bits)
    return math.exp(mean_nll(swapper.engine, ids))


def uniform_widths(swapper: ExpertSwapper, ids: list[int], tolerance: float) -> dict:
    """Perplexity at float16 and at each uniform width, and the (low, high) pair around the tolerance:
    high is the narrowest uniform width within (1 + tolerance) of float16, low the next narrower
    (low == high when even the narrowest meets it)."""
    L, E = len(swapper.rows), len(swapper.rows[0])
    base = perplexity_at(swapper, ids, [[16] * E for _ in range(L)])
    uniform = {b: perplexity_at(swapper, ids, [[b] * E for _ in range(L)]) for b in UNIFORM}
    meeting = [b for b in UNIFORM if uniform[b] <= base * (1 + tolerance)]
    high = meeting[0] if meeting else 16
    low = high if high == UNIFORM[0] else (UNIFORM[UNIFORM.index(high) - 1] if high in UNIFORM else UNIFORM[-1])
    return {"base": base, "uniform": uniform, "low": low, "high": high, "limit": base * (1 + tolerance)}


def assign_widths(swapper: ExpertSwapper, ids: list[int], imp: np.ndarray, widths: dict, log=print) -> dict:
    """Widths [L][E]: the k least important experts (by `imp`) at widths["low"], the rest at
    widths["high"], k the largest whose perplexity on `ids` stays within widths["limit"] (binary
    search; every probe is evaluated)."""
    L, E = imp.shape
    low, high, limit = widths["low"], widths["high"], widths["limit"]
    order = np.argsort(imp.reshape(-1), kind="stable")  # least important first

    def with_k(k):
        flat = np.full(L * E, high)
        flat[order[:k]] = low
        return flat.reshape(L, E).tolist()

    lo, hi, probes = 0, (L * E if low != high else 0), {}  # k = 0 is uniform `high`, which meets the limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        probes[mid] = perplexity_at(swapper, ids, with_k(mid))
        if log:
            log(f"  {mid:4d} experts at INT{low}, the rest INT{high}: perplexity {probes[mid]:.3f} (limit {limit:.3f})")
        lo, hi = (mid, hi) if probes[mid] <= limit else (lo, mid - 1)
    return {"bits": with_k(lo), "k": lo, "probes": probes}


def choose_widths(
    engine, ids: list[int], tolerance: float, importance_tokens: int = 512, progress: bool = False, log=print
) -> dict:
    """Steps 1-3 on a resident MoE engine with float experts: the uniform widths around `tolerance`,
    each expert's importance (on the first `importance_tokens` of `ids`) and the greedy assignment.
    Returns uniform_widths' fields, assign_widths' (bits [L][E], k, probes) and importance [L, E]."""
    store, lay = engine.store, engine.store.manifest.ffn
    L, E = len(lay.layer_offsets), lay.n_experts
    swapper = ExpertSwapper(engine, [[expert_rows(store, i, e) for e in range(E)] for i in range(L)])
    widths = uniform_widths(swapper, ids, tolerance)
    if log:
        log(
            f"calibration perplexity: float16 {widths['base']:.3f}; "
            + ", ".join(f"INT{b} {p:.3f}" for b, p in widths["uniform"].items())
        )
    imp = np.zeros((L, E))
    if widths["low"] != widths["high"]:
        imp = importance(swapper, ids[:importance_tokens], widths["low"], widths["high"], progress=progress)
    return dict(widths, **assign_widths(swapper, ids, imp, widths, log=log), importance=imp)
