"""Public surface: load() returns an Engine with generate() / stream_generate()."""

from __future__ import annotations

import os

import numpy as np

from .backends import get_backend
from .config import EngineConfig
from .default_model import resolve_store
from .engine import Engine
from .store import open_store
from .store.disk_profile import best_threads, coalesce_gap, default_profile
from .store.reader_pool import ReaderPool
from .store.sources import model_module
from .tokenizer import Tokenizer
from .store.ffn_reader import FFNReader
from .weights import ResidentFFN, StreamedFFN, bundle_weights, resident_getter


def load(model: str | None = None, backend: str = "mlx", ffn: str = "resident", *, device: str | None = None,
         threads: int | None = None, torch_dtype: str = "float32", precision: str = "source",
         verify_checksums: bool = False, cache_dir: str = "", prefill_chunk: int = 512, io_mode: str = "direct",
         io_threads: int | None = None, sparse_mode: str = "all", memory_budget: str | int = "50%",
         window: int = 0, predictor: str = "lowrank", predictor_recall: float | None = None,
         down_only: bool = False, expert_policy: str = "edgemoe", expert_preload: int = -1, progress: bool = True) -> Engine:
    """Load a model and return an Engine.

    model: None (the default SmolLM2-135M-Instruct), a store directory, a GGUF file, or an HF /
        mlx-community model directory (converted into the cache on first use).
    backend: "mlx" or "torch". ffn: "resident", "stream" (FFN read from the bundle file per layer) or
        "sparse" (LLM in a flash: only the rows each token needs, under `memory_budget`; `sparse_mode`
        naive / hybrid / predictor / window / all; `window` tokens of active rows cached (0: the
        planner picks it from the measured activity and the disk profile);
        `predictor` "lowrank" (tools/train_predictor.py), "gate" (resident 4-bit gate/up; thresholds
        from tools/train_predictor.py) or "dense" (every neuron: exact);
        `predictor_recall` picks the low-rank cuts calibrated for that recall: higher reads more;
        `down_only` with the gate predictor reads only down columns, computing gate/up from its
        resident 4-bit copy).
    MoE models (Mixtral, Qwen2/3-MoE, OLMoE): ffn="resident" keeps every expert in memory;
        "stream" or "sparse" reads experts when routed into a cache that `memory_budget` sizes,
        evicting by `expert_policy` (edgemoe, lru, lfu, fifo); each decode step preloads
        `expert_preload` likely experts of the next layer from the store's routing predictor
        (tools/trace_experts.py; -1: as many as a token routes to when there is one, 0: off).
    torch_dtype: "float32" (exact) or "bfloat16" (torch's fast int4 kernel; approximate).
    precision: FFN precision used when converting a GGUF/HF source (source, f16, q4, q8).
    io_mode / io_threads: how stream mode reads bundles ("direct" bypasses the page cache); thread
        count and coalescing gap default to the disk profile (tools/profile_disk.py, or a quick
        probe run once and cached).
    """
    cfg = EngineConfig(backend=backend, device=device, threads=threads, torch_dtype=torch_dtype, ffn=ffn,
                       precision=precision, prefill_chunk=prefill_chunk, verify_checksums=verify_checksums, cache_dir=cache_dir,
                       io_mode=io_mode, io_threads=io_threads, sparse_mode=sparse_mode, memory_budget=memory_budget,
                       window=window, predictor=predictor, predictor_recall=predictor_recall, down_only=down_only,
                       expert_policy=expert_policy, expert_preload=expert_preload)
    store = open_store(resolve_store(model, cfg.cache_dir, cfg.precision, progress), cfg.verify_checksums, progress)
    ops = get_backend(cfg.backend, **_backend_kwargs(cfg))
    module = model_module(store.config["model_type"], store.path)
    args = module.ModelArgs.from_dict(store.config)
    weights = module.build(ops, args, resident_getter(ops, store))
    eos = store.config.get("eos_token_id")
    tokenizer = Tokenizer(store.path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    if store.manifest.ffn.n_experts:
        ffn_source = expert_source(ops, store, cfg, ops.held_bytes(weights), progress)
    elif cfg.ffn == "resident":  # one sequential pass at load time: the page cache is fine
        with ReaderPool(threads=2, mode="buffered") as pool:
            ffn_source = ResidentFFN(ops, store, pool)
    elif cfg.ffn == "stream":
        ffn_source = StreamedFFN(ops, store, stream_pool(cfg, store.manifest.ffn.layer_nbytes, progress))
    else:
        ffn_source = sparse_source(ops, store, cfg, module, args, progress, ops.held_bytes(weights))
    engine = Engine(ops, module, args, weights, ffn_source, tokenizer, cfg, store)
    _return_free_memory()
    return engine


def _return_free_memory() -> None:
    """Converting weights at load frees large temporaries that glibc keeps in its arenas; hand them
    back to the OS so the process's RSS shows what the engine holds (a no-op without glibc)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _first_layer_rows(store):
    """Layer 0's bundle rows, to measure what one converted layer (or expert) holds in memory."""
    lay = store.manifest.ffn
    with ReaderPool(threads=2, mode="buffered") as pool:
        return FFNReader(pool, store.file_path(lay.file), lay).read_layer(0)


def _experts_held(ops, store) -> tuple[int, int]:
    """(the most one converted expert holds, what all of them hold) in backend memory, measured on
    one expert of each storage format."""
    from .moe.experts import expert_weights, read_expert

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


def expert_source(ops, store, cfg: EngineConfig, resident_held: int, progress: bool = False):
    """MoE experts: all resident (ffn="resident"), or read from flash when routed into an expert
    cache sized by cfg.memory_budget (ffn="stream" or "sparse"; "50%" is of the fully resident model)."""
    from .moe.experts import ResidentExperts, StreamedExperts
    from .moe.planner import plan_experts
    from .sparse.planner import parse_budget

    lay = store.manifest.ffn
    if cfg.ffn == "resident":  # one sequential pass at load time: the page cache is fine
        with ReaderPool(threads=2, mode="buffered") as pool:
            return ResidentExperts(ops, store, pool)
    converted, experts_held = _experts_held(ops, store)
    total = resident_held + experts_held
    slots, account = plan_experts(parse_budget(cfg.memory_budget, total), resident_held, lay, converted)
    predictor, preload = routing_predictor(store, cfg.expert_preload)
    src = StreamedExperts(ops, store, stream_pool(cfg, lay.expert_nbytes, progress), slots, cfg.expert_policy, predictor, preload)
    src.account = dict(account, model_bytes=total)
    return src


def routing_predictor(store, preload: int):
    """(predictor or None, experts to preload per layer) for cfg.expert_preload."""
    from .moe.routing import PREDICTOR_FILE, RoutingPredictor, model_id

    path = os.path.join(store.path, PREDICTOR_FILE)
    if preload == 0 or (preload < 0 and not os.path.isfile(path)):
        return None, 0
    pred = RoutingPredictor.load(path, model_id(store))
    return pred, (pred.k if preload < 0 else preload)


def sparse_source(ops, store, cfg: EngineConfig, module, args, progress: bool, resident_held: int):
    """The LLM-in-a-flash FFN source, planned under cfg.memory_budget in bytes as held (`resident_held`:
    what the backend holds for the resident tensors)."""
    from .sparse.planner import parse_budget, model_bytes, plan_budget
    from .sparse.predictor import Predictors
    from .sparse.sparse_ffn import NEEDS_PREDICTOR, AllActive, LowRankSelector, SparseFFN, down_fields

    lay = store.manifest.ffn
    selector, pbytes, activity = None, 0, None
    if cfg.sparse_mode in NEEDS_PREDICTOR:
        if cfg.predictor == "dense":
            selector = AllActive(lay.n_neurons)
        elif cfg.predictor == "gate":
            from .sparse.gateup import GateUpSelector

            preds = Predictors.load(store.path, len(lay.layer_offsets), lay.d_model, lay.n_neurons)
            thresholds, activity = preds.magnitude_thresholds, preds.activity
            # 4-bit weights run on torch's int4 kernel in its bfloat16 mode; MLX has them natively.
            sel_ops = get_backend("torch", device=cfg.device, dtype="bfloat16") if cfg.backend == "torch" else ops
            with ReaderPool(threads=2, mode="buffered") as pool:
                selector = GateUpSelector(sel_ops, module, args, lay, FFNReader(pool, store.file_path(lay.file), lay),
                                          thresholds, progress)
            pbytes = sel_ops.held_bytes(selector.weights)
        else:
            preds = Predictors.load(store.path, len(lay.layer_offsets), lay.d_model, lay.n_neurons)
            if cfg.predictor_recall is not None:
                preds.use_recall(cfg.predictor_recall)
            selector = LowRankSelector(preds, ops)
            activity = preds.activity
            pbytes = sum(p.U.nbytes + p.V.nbytes + p.b.nbytes for p in preds.layers)
    layer_held = ops.held_bytes(bundle_weights(ops, lay, _first_layer_rows(store)))
    total = model_bytes(store, resident_held, layer_held)
    budget = parse_budget(cfg.memory_budget, total)
    row_bytes = down_fields(lay)[2] if cfg.down_only else lay.bundle_bytes  # one cached row
    # Threads suit the reads this mode makes: whole layers, or single rows.
    pool = stream_pool(cfg, lay.layer_nbytes if cfg.sparse_mode in ("naive", "hybrid") else row_bytes, progress)
    plan, account = plan_budget(cfg.sparse_mode, budget, store, pbytes, cfg.window, row_bytes, activity,
                                default_profile(cfg.cache_dir), pool.threads, resident_held, layer_held)
    account["model_bytes"] = total
    src = SparseFFN(ops, store, pool, plan, selector, progress, down_only=cfg.down_only)
    src.account = account
    return src


def _backend_kwargs(cfg: EngineConfig) -> dict:
    kw = {"device": cfg.device}
    if cfg.backend == "torch":
        kw["threads"] = cfg.threads
        kw["dtype"] = cfg.torch_dtype
    return kw


def stream_pool(cfg: EngineConfig, chunk: int, progress: bool = False) -> ReaderPool:
    """A reader pool sized by the disk profile (threads for this chunk size, coalescing gap); the
    first use on a machine measures the disk (a few seconds, said on stderr when `progress`)."""
    profile = default_profile(cfg.cache_dir, progress=progress)
    threads = cfg.io_threads or best_threads(profile, min(chunk, 1 << 20))
    return ReaderPool(threads=threads, mode=cfg.io_mode, coalesce_gap=coalesce_gap(profile))
