"""What the weights' share of the memory limit holds (memory/process_plan.py gives the share): the
least the weights need, whether the whole model stays resident (ffn="auto"), and which layers'
attention is read when they compute (layer_stream.py)."""

from __future__ import annotations

from dataclasses import replace

from ..choices import PredictorKind, SparseMode
from ..config import EngineConfig, FFNMode
from ..errors import MemoryBudgetError
from ..store.sizes import expert_bytes, ffn_layer_bytes, ffn_layers, model_bytes, read_unit_bytes, resident_bytes
from ..store.sizes import vector_bytes
from ..store.stage import dropped_tensors
from ..store.store import lead
from ..units import fmt


def ffn_minimum(store) -> int:
    """The least a streamed FFN holds: one layer's (or one expert's) read buffer, the weights made
    of it, and one row per layer (what a hybrid plan needs to exist)."""
    if expert_bytes(store):
        return 2 * expert_bytes(store)
    return 2 * ffn_layer_bytes(store) + ffn_layers(store) * read_unit_bytes(store)


def copied_vectors(store) -> int:
    """What a backend may copy of the resident tensors beside the bytes read: their vectors (norms,
    biases: MLX keeps its own array of each, cast to float32 at most twice the stored size)."""
    return 2 * vector_bytes(store)


def weights_minimum(store) -> int:
    """The least the weights can be held in: the tensors of no layer (embeddings, head) as stored,
    two layers' resident tensors (streamed through two slots; all layers for a store whose file
    does not keep layers together), the streamed FFN's minimum and the vectors a backend copies."""
    regions = store.layer_regions()
    res = resident_bytes(store)
    if regions:
        sizes = [n for *_, n in regions.values()]
        res += min(2, len(sizes)) * max(lead(off) + n for _, off, n in regions.values()) - sum(sizes)
    return res + ffn_minimum(store) + copied_vectors(store)


def streamed_layers(cfg: EngineConfig, store, weights_budget: int) -> list[int]:
    """The layers whose resident tensors are read when they compute (the last ones; the first stay
    resident): none when every layer fits beside the streamed FFN's minimum."""
    regions = store.layer_regions()
    need = resident_bytes(store) + ffn_minimum(store)
    if cfg.ffn is FFNMode.RESIDENT or not regions or need <= weights_budget:
        return []
    sizes = [n for *_, n in regions.values()]
    others = resident_bytes(store) - sum(sizes)
    keep = max(0, (weights_budget - others - ffn_minimum(store) - copied_vectors(store) - 2 * max(sizes)) // max(sizes))
    return sorted(regions)[min(keep, len(sizes)) :]


def resolve_ffn(cfg: EngineConfig, store, plan, batch: bool = False) -> EngineConfig:
    """ffn="auto" made concrete: resident when the whole model as stored fits the weights' share of the
    limit, else exact streaming (a dense FFN: hybrid sparse with every neuron computed, or, for the
    throughput mode (`batch`), whole layers read once per step for the whole batch; MoE: streamed
    experts); an explicit ffn="resident" that does not fit is refused with what it needs."""
    need = model_bytes(store) + ffn_layer_bytes(store)  # + the load-time read buffer
    fits = need <= plan.weights_budget
    if cfg.ffn is FFNMode.RESIDENT and not fits:
        raise MemoryBudgetError(
            f"ffn resident needs {fmt(need)} for "
            f"weights; the memory budget leaves {fmt(plan.weights_budget)} ({plan.limit.how}): "
            "use ffn auto or stream, or a larger memory budget"
        )
    blocks = store.manifest.ffn.has_blocks
    if cfg.ffn is not FFNMode.AUTO:
        return cfg
    if fits:
        return replace(cfg, ffn=FFNMode.RESIDENT)
    if expert_bytes(store) or batch or blocks:  # (block types: exact dense streaming, see above)
        return replace(cfg, ffn=FFNMode.STREAM)
    return replace(
        cfg, ffn=FFNMode.SPARSE, flash=replace(cfg.flash, mode=SparseMode.HYBRID, predictor=PredictorKind.DENSE)
    )


def weights_line(cfg: EngineConfig, store, account: dict) -> str:
    """What the weights' share holds, for the plan line."""
    lay = store.manifest.ffn
    if cfg.ffn is FFNMode.RESIDENT:
        return f"the whole model resident ({fmt(model_bytes(store))} as stored)"
    # (an inner pipeline stage holds no embeddings: store/stage.py)
    inner = bool(dropped_tensors(store))
    embeddings = "" if inner else "embeddings and "
    attn = "attention resident" if inner else "attention and embeddings resident"
    if account["streamed_layers"]:
        attn = (
            f"{embeddings}{len(lay.layer_offsets) - account['streamed_layers']} layers' attention resident, "
            f"{account['streamed_layers']} layers' attention read when they compute"
        )
    if "expert_slots" in account:
        return (
            f"{attn}, {account['expert_slots']} of {len(lay.layer_offsets) * lay.n_experts} "
            f"experts cached, the rest read when routed"
        )
    if "ffn_rows_per_layer" in account:
        share = account["ffn_rows_per_layer"] / max(1, lay.n_rows)
        return (
            f"{attn}, {share:.0%} of each FFN layer cached, the rest read every token "
            f"({cfg.flash.mode.value}, predictor {cfg.flash.predictor.value})"
        )
    return f"{attn}, every FFN layer read each token"
