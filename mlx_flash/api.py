"""Public surface: load() returns an Engine with generate() / stream_generate()."""

from __future__ import annotations

import dataclasses
import sys

from .backends import get_backend
from .backends.choice import choose_backend
from .config import Backend, EngineConfig, FFNMode, TorchDtype, default_cache_dir
from .default_model import resolve_store
from .engine import Engine, model_context
from .errors import ConfigError
from .kernels import torch_ops
from .layer_stream import LayerSlots, StreamedLayers
from .memory import ModelShape, process_rss, resolve_limit
from .memory.allocator import return_free_memory
from .memory.load_plan import plan_load
from .memory.process_plan import check_backend_room
from .memory.weights_plan import weights_line
from .models import MODEL_TYPES, model_module
from .moe.build import expert_source
from .options import ExpertOptions, FlashOptions, IOOptions
from .sparse.activation_sparsity import sparsity_line, sparsity_products
from .sparse.build import sparse_source
from .store import open_store
from .store.reader_pool import ReaderPool
from .store.stream_pool import stream_pool
from .tokenizer import Tokenizer
from .weights import ResidentFFN, StreamedFFN, resident_getter


def load(
    model: str | None = None,
    backend: str = "auto",
    ffn: str = "auto",
    *,
    memory_budget: str | int = "auto",
    weights_budget: str | int | None = None,
    context: int = 0,
    kv_on_flash: bool = True,
    kv_flash_bits: int = 0,
    precision: str = "auto",
    threads: int | None = None,
    progress: bool = True,
    flash: FlashOptions | None = None,
    experts: ExpertOptions | None = None,
    io: IOOptions | None = None,
    device: str | None = None,
    torch_dtype: str = "float32",
    arithmetic: str = "auto",
    sparsity: float = 0.0,
    sparsity_rows: str = "decode",
    prefill_chunk: int = 512,
    verify_checksums: bool = False,
    cache_dir: str = "",
    batch: bool = False,
) -> Engine:
    """Load a model and return an Engine.

    model: None (the default SmolLM2-135M-Instruct), a store directory, a GGUF file, an HF /
        mlx-community model directory (converted into the cache on first use), or a hub name
        ("org/name", "org/name:Q4_K_M": the Hugging Face cache, else a download; locate/hub.py).
    backend: "auto" (MLX on Apple silicon; elsewhere torch when installed, else MLX on the CPU), "mlx"
        or "torch". ffn: "auto" (resident when the model fits memory_budget, else exact
        streaming), "resident", "stream" or "sparse" (LLM in a flash on dense models; on MoE models
        "stream" and "sparse" both read experts when routed into a cache).
    memory_budget: the cap on the whole process's peak RSS ("auto", "60%" of the available memory,
        or bytes); weights_budget: the weights' and caches' share of it; context: KV tokens planned;
        kv_on_flash: a context longer than the KV share holds keeps its older tokens on flash;
        kv_flash_bits: those tokens compressed to 8, 4 or 2 bits (0: exact).
    arithmetic: "exact" (float32, the checkpoint's values; what "auto", the default, takes) or "q8"
        (activations as 8-bit codes, integer dot products as llama.cpp computes: faster on a CPU, and
        its answers are llama.cpp's rather than exact's).
    sparsity: the share of every product's inputs treated as zero in decode steps (0.4: 40%), by
        thresholds measured once with python -m mlx_flash.sparsify (TEAL); 0, the default, is dense.
    flash / experts / io: the options of sparse FFNs, expert caches and reads (mlx_flash.options).
    Every keyword is an EngineConfig field, documented there (mlx_flash.config) and in the chat's --help.
    progress: conversion, disk-probe and load progress on stderr.
    batch: the engine is for engine.generate_batch (throughput mode): ffn="auto" then reads whole FFN
        layers once per step for a whole batch when the model does not fit, instead of sparse reads.
    """
    cfg = EngineConfig(
        backend=backend,
        ffn=ffn,
        memory_budget=memory_budget,
        weights_budget=weights_budget,
        context=context,
        kv_on_flash=kv_on_flash,
        kv_flash_bits=kv_flash_bits,
        precision=precision,
        threads=threads,
        device=device,
        torch_dtype=torch_dtype,
        arithmetic=arithmetic,
        sparsity=sparsity,
        sparsity_rows=sparsity_rows,
        prefill_chunk=prefill_chunk,
        verify_checksums=verify_checksums,
        cache_dir=cache_dir,
        flash=flash,
        experts=experts,
        io=io,
    )
    return load_config(model, cfg, progress, batch)


def load_config(model: str | None, cfg: EngineConfig, progress: bool = True, batch: bool = False) -> Engine:
    """load() for a whole EngineConfig (the chat builds one from its flags). batch: for the throughput
    mode (generate_batch), ffn="auto" streams whole FFN layers when the model does not fit."""
    limit = resolve_limit(cfg.memory_budget)  # a malformed budget is refused before any conversion
    chosen, why = choose_backend(cfg.backend.value, cfg.device)
    cfg = dataclasses.replace(cfg, backend=Backend(chosen))
    if cfg.backend is Backend.TORCH and cfg.torch_dtype is TorchDtype.FLOAT32:  # built while the model converts
        torch_ops.build_in_background(progress)
    store = open_store(
        resolve_store(model, cfg.cache_dir, cfg.store_precision(), progress),
        cfg.verify_checksums,
        progress,
        cfg.cache_dir,
    )
    check_backend_room(limit, cfg.backend.value, process_rss(), cfg.cache_dir or default_cache_dir())
    ops = backend_ops(cfg, cfg.backend)
    module = model_module(store.config["model_type"], store.path)
    args = module.ModelArgs.from_dict(store.config)
    if cfg.kv_flash_bits and not MODEL_TYPES[store.config["model_type"]].causal_attention:
        raise ConfigError(
            f"kv_flash_bits {cfg.kv_flash_bits}: {store.config['model_type']}'s sliding-window layers attend "
            "through a mask compressed KV on flash does not take (use 0, exact)"
        )
    eos = store.config.get("eos_token_id")
    tokenizer = Tokenizer(store.path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    return_free_memory()
    planned = plan_load(
        cfg, store, limit, ModelShape.from_config(store.config), model_context(args), ops.in_place_kernel, batch
    )
    cfg, plan, tiers, streamed = planned.config, planned.process, planned.tiers, planned.streamed
    slots = (
        LayerSlots(
            store,
            streamed,
            stream_pool(
                cfg.cache_dir,
                max(n for *_, n in store.layer_regions().values()),
                cfg.io.mode.value,
                cfg.io.threads,
                progress,
            ),
            ops,
        )
        if streamed
        else None
    )
    weights = module.build(ops, args, resident_getter(ops, store, slots))
    held = ops.held_bytes(weights)  # before the layers are wrapped: counting them must not read them
    if slots is not None:
        for i in streamed:
            slots.attach(ops, weights["layers"][i], i)
        weights["layers"] = StreamedLayers(weights["layers"], slots)
    ffn_source, account = ffn_source_for(ops, store, cfg, module, args, held, plan, progress)
    thresholded = sparsity_products(ops, store, cfg, weights, ffn_source, len(streamed)) if cfg.sparsity else []
    account = {
        **account,
        "streamed_layers": len(streamed),
        "layer_slots": slots.nbytes if slots else 0,
        "backend": f"{ops.describe()} ({why})",
        "arithmetic": ops.arithmetic.line(),
        "sparsity": sparsity_line(cfg, thresholded),
    }
    if progress:
        print(f"backend: {account['backend']}", file=sys.stderr)
        print(f"arithmetic: {account['arithmetic']}", file=sys.stderr)
        if thresholded:
            print(f"sparsity: {account['sparsity']}", file=sys.stderr)
        print(plan.line(weights_line(cfg, store, account)), file=sys.stderr)
    engine = Engine(
        ops,
        module,
        args,
        weights,
        ffn_source,
        tokenizer,
        cfg,
        store,
        {**plan.account(), **account},
        kv_tokens=plan.kv_tokens,
        layer_slots=slots,
        kv_tiers=tiers,
        thresholded=thresholded,
    )
    return_free_memory()
    return engine


def ffn_source_for(ops, store, cfg: EngineConfig, module, args, resident_held: int, plan, progress: bool):
    """(the FFN source cfg asks for, how the weights' share of the limit was split: empty when the
    FFN is resident or streamed whole)."""
    cap = plan.weights_budget
    if store.manifest.ffn.n_experts:
        return expert_source(ops, store, cfg, resident_held, cap, progress)
    if cfg.ffn is FFNMode.RESIDENT:  # one sequential pass at load time: the page cache is fine
        with ReaderPool(threads=2, mode="buffered") as pool:
            return ResidentFFN(ops, store, pool), {}
    if cfg.ffn is FFNMode.STREAM:
        lay = store.manifest.ffn
        return StreamedFFN(
            ops, store, stream_pool(cfg.cache_dir, lay.layer_nbytes, cfg.io.mode.value, cfg.io.threads, progress)
        ), {}

    # 4-bit gate predictor weights run on torch's int4 kernel in its bfloat16 mode; MLX has them natively.
    gate_ops = backend_ops(cfg, Backend.TORCH, "bfloat16") if cfg.backend is Backend.TORCH else ops
    return sparse_source(ops, store, cfg, module, args, resident_held, gate_ops, cap, progress)


def backend_ops(cfg: EngineConfig, backend: Backend, torch_dtype: str | None = None):
    """The ops of `backend` as cfg asks; torch_dtype: another torch mode (the gate predictor's
    bfloat16 ops, whose own products are not the CPU kernels': their arithmetic is exact)."""
    if backend is Backend.TORCH:
        dtype, arithmetic = torch_dtype or cfg.torch_dtype.value, "exact" if torch_dtype else cfg.arithmetic.value
        return get_backend("torch", device=cfg.device, threads=cfg.threads, dtype=dtype, arithmetic=arithmetic)
    return get_backend("mlx", device=cfg.device, threads=cfg.threads, arithmetic=cfg.arithmetic.value)
