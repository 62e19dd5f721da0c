"""Read-only views of a loaded engine: how the memory budget was split, and what the expert cache
did. Per-token timings and bytes are in `engine.last.steps` (TokenStats); these cover what lives
longer than one generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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


@dataclass(frozen=True)
class SparsityStats:
    """What the thresholds did since load, over the products the kernel ran thresholded (the reference
    path's products are not counted: it reads every byte). Every field is always present."""

    rows: int = 0  # product rows run thresholded (a decode step counts one for each product)
    inputs: int = 0  # input channels of those rows
    active: int = 0  # ... of which above their threshold
    dense_bytes: int = 0  # bytes those rows would have read dense
    read_bytes: int = 0  # bytes they read: active channels' codes and active groups' scales

    @property
    def zeroed_share(self) -> float:
        return 1.0 - self.active / self.inputs if self.inputs else 0.0

    @property
    def skipped_share(self) -> float:
        return 1.0 - self.read_bytes / self.dense_bytes if self.dense_bytes else 0.0


def sparsity_counts(weights) -> SparsityStats:
    """The sum over `weights` (backends/thresholded.py's Thresholded) of what their kernels counted."""
    rows = inputs = active = dense = read = 0
    for w in weights:
        counts = w.counts()
        if counts is None:
            continue
        r, channels, groups = (int(v) for v in counts)
        rows += r
        inputs += r * w.n_in
        active += channels
        dense += r * w.dense_bytes
        read += channels * w.channel_bytes + groups * w.group_bytes
    return SparsityStats(rows, inputs, active, dense, read)


def sparsity_stats(engine) -> dict:
    """What activation sparsity (load(..., sparsity=s)) did since load: product rows run thresholded,
    the share of their inputs zeroed, and the bytes they read against what dense products would have
    read (with the share skipped); all zero when sparsity is off or no product runs on the kernel."""
    c = sparsity_counts(engine.thresholded)
    steps = c.rows / len(engine.thresholded) if c.rows else 0  # every product runs one row a decode step
    return {
        "level": engine.config.sparsity,
        **asdict(c),
        "zeroed_share": c.zeroed_share,
        "skipped_share": c.skipped_share,
        "read_bytes_per_token": c.read_bytes / steps if steps else 0.0,
        "dense_bytes_per_token": c.dense_bytes / steps if steps else 0.0,
        "predicted_bytes_per_token": predicted_bytes(engine.thresholded, engine.config.sparsity),
    }


def predicted_bytes(weights, level: float) -> float:
    """Bytes a decode step's thresholded products read, as the level predicts them: the share
    1 - level of each product's channels (each threshold is its input's quantile at its own level on
    calibration text, and those levels average, weighted by the weights each input feeds, to the
    model-wide one: the bytes are in that proportion), and every group's scales unless all its
    channels are zeroed (taken as independent)."""
    total = 0.0
    for w in weights:
        if w.counts() is None:
            continue
        groups = w.n_in // max(w.group, 1)
        total += (1 - level) * w.n_in * w.channel_bytes + groups * (1 - level**w.group) * w.group_bytes
    return total


def sparsity_words(engine) -> str:
    """One line of what the thresholds did since load (the chat's /stats)."""
    s = sparsity_stats(engine)
    if not s["rows"]:
        return f"sparsity {s['level']:.0%}: no thresholded step on the kernel yet"
    return (
        f"sparsity {s['level']:.0%}: {s['zeroed_share']:.1%} of the products' inputs zeroed since load; a token "
        f"reads {s['read_bytes_per_token'] / 1e6:.1f} MB of their {s['dense_bytes_per_token'] / 1e6:.1f} MB "
        f"({s['skipped_share']:.0%} skipped)"
    )
