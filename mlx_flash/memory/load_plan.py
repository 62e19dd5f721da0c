"""A model's whole memory plan at load, from the store's sizes and the limit: the process's split
(process_plan.py), the KV tiers a long context keeps on flash, the weights' share (`weights_budget`
or what the split leaves), what ffn="auto" becomes and which layers' attention streams
(weights_plan.py). The caller hands in values (the limit, the model's shape, whether the backend's
kernels read KV in place); nothing here calls back into the engine or a backend."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

from ..budget import weights_budget
from ..config import EngineConfig, FFNMode, default_cache_dir
from ..durable import free_bytes
from ..errors import MemoryBudgetError
from ..models.kv_coded_blocks import BlockFormat
from ..models.kv_tiers import EVICT_STEP, TierPlan
from ..store.kv_tier_file import KVBlockFile, KVTierFile, check_tier_folder
from ..store.sizes import expert_bytes, model_bytes
from ..store.stream_pool import stream_pools_bytes
from .available import process_rss
from .limit import MemoryLimit
from .process_plan import ModelShape, ProcessPlan, plan_process, plan_tiers
from .weights_plan import resolve_ffn, streamed_layers, weights_minimum


@dataclass
class LoadPlan:
    """What the engine is assembled by: `config` with ffn settled and the prefill chunk the buffers were
    planned for, the process's split, one sequence's KV tiers (None: every token resident), the layers
    whose attention is read when they compute."""

    config: EngineConfig
    process: ProcessPlan
    tiers: TierPlan | None
    streamed: list[int]


def plan_load(
    cfg: EngineConfig,
    store,
    limit: MemoryLimit,
    shape: ModelShape,
    context_limit: int,
    in_place_kernel: bool,
    batch: bool = False,
) -> LoadPlan:
    """The plan of a model of `shape` (its context `context_limit`) from `store` under `limit`.
    in_place_kernel: the backend's kernels read KV where it lies (what KV tiers need). batch: for
    the throughput mode, ffn="auto" streams whole FFN layers when the model does not fit."""
    least = weights_minimum(store)
    readers = stream_pools_bytes(cfg.cache_dir or default_cache_dir(), cfg.io.threads)

    def planned(context: int) -> ProcessPlan:
        rss = process_rss()
        return plan_process(
            limit, rss, cfg.backend.value, shape, context_limit, least, context, cfg.prefill_chunk, readers
        )

    plan, tiers = _plan_with_tiers(cfg, in_place_kernel, planned, shape, context_limit, least)
    cfg = dataclasses.replace(cfg, prefill_chunk=plan.prefill_chunk)  # the chunk its buffers were planned for
    # (below what a streamed dense FFN holds it is refused here; below what a sparse or expert FFN needs,
    # by that FFN's planner, with its own minimum: neither holds one whole layer's reads)
    plan.weights_budget = weights_budget(
        cfg.weights_budget,
        model_bytes(store),
        plan.weights_budget,
        least if cfg.ffn is FFNMode.STREAM and not expert_bytes(store) else 0,
    )
    cfg = resolve_ffn(cfg, store, plan, batch)
    return LoadPlan(cfg, plan, tiers, streamed_layers(cfg, store, plan.weights_budget))


def _plan_with_tiers(cfg: EngineConfig, in_place_kernel: bool, planned, shape, context_limit: int, least: int):
    """(the process plan, the KV tiers it gives one sequence or None): with kv_on_flash on a backend
    whose kernels read KV in place, a context the KV share cannot hold resident (the model's, or
    --context) keeps its older tokens on flash (process_plan.plan_tiers) where the read buffers fit
    and the disk of the tier folder holds them (else the context is cut, and the plan says so); an
    explicit context that fits neither way is refused as without tiers, and so is a tier folder no
    file can be made in (a plain file, a read-only disk)."""
    usable = cfg.kv_on_flash and in_place_kernel
    coded = BlockFormat(cfg.kv_flash_bits, shape.kv_heads, shape.head_dim, EVICT_STEP) if cfg.kv_flash_bits else None
    on_flash = coded.bytes_per_token() * shape.layers if coded else 0
    folder = _tier_folder(cfg)
    try:
        plan = planned(cfg.context)
    except MemoryBudgetError:
        if not (usable and cfg.context):
            raise
        plan = plan_tiers(
            planned(0), shape, cfg.context, least, _disk_free(folder), True, on_flash, cfg.kv_flash_bits, folder
        )
        if not plan.tier_context:
            raise
    else:
        if usable:
            want = cfg.context or context_limit
            plan = plan_tiers(
                plan, shape, want, least, _disk_free(folder), bool(cfg.context), on_flash, cfg.kv_flash_bits, folder
            )
    if not plan.tier_context:
        return plan, None
    check_tier_folder(folder)  # a folder no file can be made in is refused now, not at the first long prompt
    L, H, D, n = shape.layers, shape.kv_heads, shape.head_dim, plan.tier_context
    return plan, TierPlan(
        window=plan.kv_tokens - plan.prefill_chunk,
        chunk=plan.prefill_chunk,
        context=n,
        layers=L,
        kv_heads=H,
        head_dim=D,
        open_file=(
            functools.partial(KVBlockFile, folder, L, EVICT_STEP, coded.nbytes, n)
            if coded
            else functools.partial(KVTierFile, folder, L, H, D, n)
        ),
        coded=coded,
    )


def _tier_folder(cfg: EngineConfig) -> str:
    """Where sequences' older KV goes: beside the stores, on the flash they stream from."""
    return os.path.join(cfg.cache_dir or default_cache_dir(), "kv")


def _disk_free(folder: str) -> int:
    """Bytes a file may still take on the disk `folder` is (or would be) on (0: it cannot be asked)."""
    return free_bytes(folder) or 0
