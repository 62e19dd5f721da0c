"""Build the expert source of a MoE model: every expert resident, or read from flash when routed
into an expert cache that memory_budget sizes (EdgeMoE), with the store's routing predictor
preloading the next layer's likely experts."""

from __future__ import annotations

import os

import numpy as np

from ..config import FFNMode
from ..ffn_source import ExpertSource
from ..store.reader_pool import ReaderPool
from ..store.stream_pool import stream_pool
from .experts import ResidentExperts, StreamedExperts, expert_weights, read_expert
from .planner import plan_experts
from .routing import PREDICTOR_FILE, RoutingPredictor, model_id


def experts_held(ops, store) -> tuple[int, int]:
    """(the most one converted expert holds, what all of them hold) in backend memory, measured on
    one expert of each storage format."""
    lay = store.manifest.ffn
    held, total = {}, 0
    buf = np.empty(lay.expert_nbytes, np.uint8)
    with ReaderPool(threads=1, mode="buffered") as pool:
        f = pool.open(store.file_path(lay.file))
        for i in range(len(lay.layer_offsets)):
            for e in range(lay.n_experts):
                kind = lay.expert_layout(i, e).precision
                if kind not in held:
                    read_expert(pool, f, lay, i, e, buf)
                    held[kind] = ops.held_bytes(expert_weights(ops, lay, i, e, buf))
                total += held[kind]
    return max(held.values()), total


def routing_predictor(store, preload: int):
    """(predictor or None, experts to preload per layer) for ExpertOptions.preload."""
    path = os.path.join(store.path, PREDICTOR_FILE)
    if preload == 0 or (preload < 0 and not os.path.isfile(path)):
        return None, 0
    pred = RoutingPredictor.load(path, model_id(store))
    return pred, (pred.k if preload < 0 else preload)


def expert_source(ops, store, cfg, resident_held: int, cap: int, progress: bool = False) -> tuple[ExpertSource, dict]:
    """(source, how the planner split the budget; empty for resident experts). ffn="resident": every
    expert read once at load; "stream"/"sparse": an expert cache sized by `cap` (the weights' share of
    the process's memory limit, cfg.weights_budget when given)."""
    lay = store.manifest.ffn
    if cfg.ffn is FFNMode.RESIDENT:  # one sequential pass at load time: the page cache is fine
        with ReaderPool(threads=2, mode="buffered") as pool:
            return ResidentExperts(ops, store, pool), {}
    converted, all_held = experts_held(ops, store)
    total = resident_held + all_held
    slots, account = plan_experts(cap, resident_held, lay, converted)
    predictor, preload = routing_predictor(store, cfg.experts.preload)
    pool = stream_pool(cfg.cache_dir, lay.expert_nbytes, cfg.io.mode.value, cfg.io.threads, progress)
    src = StreamedExperts(ops, store, pool, slots, cfg.experts.policy, predictor, preload)
    return src, dict(account, model_bytes=total)
