"""Build the LLM-in-a-flash FFN source for a dense model (load() with ffn="sparse"): the selector the
options name, the planner's split of memory_budget, and the source for the mode."""

from __future__ import annotations

from ..errors import ConfigError
from ..kernels.slab_spec import spec_of
from ..options import FlashOptions
from ..store.disk_profile import default_profile
from ..store.ffn_reader import FFNReader
from ..store.reader_pool import ReaderPool
from ..store.sizes import model_bytes
from ..store.stream_pool import stream_pool
from ..weights import bundle_weights
from .cached_rows import CachedRowsFFN
from .dense_slab import DenseSlabFFN
from .modes import SparseKernel
from .planner import plan_budget
from .predictor import Predictors
from .thresholds import load_thresholds
from .row_format import BundleFile, BundleRows, DownRows, FieldFile, down_fields
from .selectors import AllActive, LowRankSelector, PredictorKind, StatisticalSelector
from .statistical import StatisticalActivity
from .sparse_source import SparseSource
from .unbundled import ensure_unbundled, field_offsets
from .gateup import GateUpSelector


def _first_layer_rows(store):
    """Layer 0's bundle rows, to measure what one converted layer holds in memory."""
    lay = store.manifest.ffn
    with ReaderPool(threads=2, mode="buffered") as pool:
        return FFNReader(pool, store.file_path(lay.file), lay).read_layer(0)


def make_selector(ops, store, opts: FlashOptions, module, args, gate_ops, progress: bool, sparsity: float = 0.0):
    """(selector, bytes it holds, activity measured at training or None) for opts.predictor.
    gate_ops: the backend the gate predictor's 4-bit weights run on. With `sparsity` (load(...,
    sparsity=s)) the gate predictor selects the neurons whose activation is above down's input
    threshold at that level (sparse/thresholds.py): the resident model's down product skips the same
    neurons, so the sparse FFN reads exactly the rows the thresholds leave; no trained predictor is
    needed."""
    lay = store.manifest.ffn
    if sparsity:
        if opts.predictor is not PredictorKind.GATE:
            raise ConfigError(
                f"sparsity {sparsity:g} with ffn='sparse' selects neurons by down's input thresholds, which "
                f"predictor 'gate' computes; predictor {opts.predictor.value!r} selects otherwise (use 'gate')"
            )
        found = load_thresholds(store, len(lay.layer_offsets), "--precision source-neuron").at(sparsity)["down"]
        return (*gate_selector(store, module, args, gate_ops, found, progress), None)
    if opts.predictor is PredictorKind.DENSE:
        return AllActive(lay.n_neurons), 0, None
    if opts.predictor is PredictorKind.STATISTICAL:
        model = StatisticalActivity(len(lay.layer_offsets), lay.n_rows, active=opts.statistical_active)
        return StatisticalSelector(model, lay.block), model.p.nbytes, None
    preds = Predictors.load(store.path, len(lay.layer_offsets), lay.d_model, lay.n_neurons)
    if opts.predictor is PredictorKind.GATE:
        return (*gate_selector(store, module, args, gate_ops, preds.magnitude_thresholds, progress), preds.activity)
    if opts.recall is not None:
        preds.use_recall(opts.recall)
    return LowRankSelector(preds, ops), sum(p.U.nbytes + p.V.nbytes + p.b.nbytes for p in preds.layers), preds.activity


def gate_selector(store, module, args, gate_ops, thresholds, progress: bool):
    """(the gate predictor over the store's gate|up rows with these per-layer thresholds, bytes it holds)."""
    lay = store.manifest.ffn
    with ReaderPool(threads=2, mode="buffered") as pool:
        sel = GateUpSelector(
            gate_ops, module, args, lay, FFNReader(pool, store.file_path(lay.file), lay), thresholds, progress
        )
    return sel, gate_ops.held_bytes(sel.weights)


def sparse_source(
    ops, store, cfg, module, args, resident_held: int, gate_ops, cap: int, progress: bool = False
) -> tuple[SparseSource, dict]:
    """(the source for cfg.flash, how the planner split the budget): planned under `cap`, the weights'
    share of the process's memory limit (cfg.weights_budget when given), in bytes as held
    (`resident_held`: what the backend holds for the resident tensors)."""
    opts, lay = cfg.flash, store.manifest.ffn
    selector, pbytes, activity = None, 0, None
    if opts.mode.needs_predictor:
        selector, pbytes, activity = make_selector(ops, store, opts, module, args, gate_ops, progress, cfg.sparsity)
    layer_held = ops.held_bytes(bundle_weights(ops, lay, _first_layer_rows(store)))
    # the fully resident model holds each layer's weights: converted copies, or (0 held beyond the
    # rows: weights that are views) the layer's bytes as stored
    total = model_bytes(store, resident_held, layer_held or lay.layer_nbytes)
    budget = cap
    row_bytes = down_fields(lay)[2] if opts.down_only else lay.bundle_bytes  # one cached row
    # Threads suit the reads this mode makes: whole layers, or single rows.
    pool = stream_pool(
        cfg.cache_dir,
        row_bytes if opts.mode.needs_predictor else lay.layer_nbytes,
        cfg.io.mode.value,
        cfg.io.threads,
        progress,
    )
    plan, account = plan_budget(
        opts.mode,
        budget,
        store,
        pbytes,
        opts.window,
        row_bytes,
        activity,
        default_profile(cfg.cache_dir),
        pool.threads,
        resident_held,
        layer_held,
    )
    account["model_bytes"] = total
    if not opts.mode.needs_predictor:
        return DenseSlabFFN(ops, store, pool, plan), account
    # Whole-bundle rows of a layout the kernels read: decode steps compute on the cache's slots.
    kernel, spec = None, spec_of(lay)  # (a spec only for gated FFNs: their module names the gate's activation)
    if opts.kernel is SparseKernel.AUTO and not opts.down_only and spec is not None:
        kernel = ops.sparse_kernel(spec, module.GATE_ACTIVATION)
    return CachedRowsFFN(
        ops, store, pool, plan, *row_source(ops, store, pool, opts, selector, progress), selector, kernel
    ), account


def row_source(ops, store, pool, opts: FlashOptions, selector, progress: bool):
    """(row format, where rows are read from) for the options: whole bundles from the bundle file
    (all), from the unbundled per-field copy (predictor, window), or down columns alone (down-only)."""
    lay = store.manifest.ffn
    if opts.down_only:
        if not isinstance(selector, GateUpSelector):
            raise ConfigError("down-only reads need the gate predictor")
        fmt = DownRows(ops, lay, selector.weights)
    else:
        fmt = BundleRows(ops, lay)
    if opts.mode.bundled_reads and not opts.down_only:
        return fmt, BundleFile(pool, pool.open(store.file_path(lay.file)), lay)
    # down-only reads the unbundled down matrix in every mode
    return fmt, FieldFile(pool, pool.open(ensure_unbundled(store, progress)), field_offsets(lay)[0], fmt)


def replay_source(store, pool, plan, progress: bool = False) -> SparseSource:
    """A source whose reads an activity drives without a model (I/O replay on synthetic stores)."""
    if not plan.mode.needs_predictor:
        return DenseSlabFFN(None, store, pool, plan)
    opts = FlashOptions(mode=plan.mode, predictor=PredictorKind.DENSE)
    return CachedRowsFFN(None, store, pool, plan, *row_source(None, store, pool, opts, None, progress))
