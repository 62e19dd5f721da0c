"""Calibrate activation-sparsity thresholds (sparse/thresholds.py): run the model, dense, over a
calibration text and record the magnitude of every input of every thresholded product, per layer;
save the quantiles beside the store.

Magnitudes go into a histogram per (layer, input) with 1,000 bins per decade from 1e-10 to 1e4
(a relative resolution of 0.23%), so a calibration of any length holds a fixed few megabytes and
the quantiles come from every value, not a sample.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np

from ..api import load
from ..errors import ConfigError
from ..weights import ResidentFFN
from .corpora import read_corpus
from .perplexity_eval import token_nlls
from ..choices import SparsityRows
from ..sparse.activation_sparsity import threshold_products
from ..sparse.thresholds import PERCENTS, ROLES, Thresholds, save_thresholds, store_fingerprint

LOW, DECADES, PER_DECADE = -10, 14, 1000
BINS = DECADES * PER_DECADE


def histogram(x: np.ndarray) -> np.ndarray:
    """Counts of |x| in the log bins (zeros and anything below 1e-10 in the first)."""
    a = np.abs(x.astype(np.float32, copy=False)).reshape(-1)
    with np.errstate(divide="ignore"):
        b = np.floor((np.log10(a) - LOW) * PER_DECADE)
    b = np.clip(np.nan_to_num(b, nan=0.0, neginf=0.0), 0, BINS - 1).astype(np.int64)
    return np.bincount(b, minlength=BINS)


def quantiles(counts: np.ndarray) -> np.ndarray:
    """float32 [PERCENTS]: the magnitude below which p% of the counted values fall, p = 0..99 (p = 0
    is 0: no input is zeroed)."""
    cum = np.cumsum(counts, dtype=np.float64)
    total = cum[-1]
    out = np.zeros(PERCENTS, dtype=np.float32)
    for p in range(1, PERCENTS):
        want = total * p / 100.0
        b = int(np.searchsorted(cum, want))
        before = cum[b - 1] if b else 0.0
        frac = (want - before) / max(counts[b], 1)  # within the bin, log-linear
        out[p] = 10.0 ** (LOW + (b + frac) / PER_DECADE)
    return np.maximum.accumulate(out)


class InputWatcher:
    """The engine's ops with `linear` handing each watched product's input (`where`: id of the weight
    -> (layer, role)) to `seen` before the product, which may change it (offline only: the per-token
    path never wraps its ops). `gated_ffn` answers None so gate|up and down run as separate products,
    each of which is seen."""

    def __init__(self, ops, where: dict[int, tuple[int, str]]):
        self._ops, self._where = ops, where

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def gated_ffn(self, act, gate_up, down, x):
        return None

    def linear(self, x, w):
        found = self._where.get(id(w))
        return self._ops.linear(x if found is None else self.seen(x, w, found), w)

    def seen(self, x, w, found: tuple[int, str]):
        """The input the product multiplies, given the one it was handed."""
        return x


@contextmanager
def watching(engine, ops: InputWatcher):
    """engine.ops is `ops` inside."""
    inner, engine.ops = engine.ops, ops
    try:
        yield ops
    finally:
        engine.ops = inner


class RecordingOps(InputWatcher):
    """Counts each thresholded input's magnitudes into its (layer, role) histogram."""

    def __init__(self, ops, where: dict[int, tuple[int, str]], n_layers: int):
        super().__init__(ops, where)
        self.counts = {r: np.zeros((n_layers, BINS), dtype=np.int64) for r in ROLES}

    def seen(self, x, w, found):
        layer, role = found
        self.counts[role][layer] += histogram(self._ops.to_numpy(x))
        return x


def thresholded_weights(engine) -> dict[int, tuple[int, str]]:
    """id of each weight the thresholds apply to -> (layer, role); a weight given as parts (products
    of differing quantization) is listed part by part."""
    where = {}

    def add(w, layer, role):
        for part in w if isinstance(w, tuple) else (w,):
            where[id(part)] = (layer, role)

    for i in range(engine.args.num_hidden_layers):
        lw = engine.weights["layers"][i]
        add(lw["qkv"], i, "qkv")
        add(lw["o"], i, "o")
        fw = engine.ffn.layer(i)
        if fw.gate_up is None:
            raise ConfigError("sparsity thresholds need a gated FFN (SwiGLU or GeGLU); this model's FFN is ungated")
        add(fw.gate_up, i, "gate_up")
        add(fw.down, i, "down")
    return where


def calibrate(engine, text: str, tokens: int = 8192, context: int = 512, progress: bool = True) -> Thresholds:
    """Thresholds of a dense, resident engine measured on the first `tokens` tokens of `text`, fed in
    independent windows of `context` tokens."""
    if not isinstance(engine.ffn, ResidentFFN):
        raise ConfigError("sparsity thresholds are measured on a resident FFN (load with ffn='resident')")
    ids = engine.tokenizer.encode(text)[:tokens]
    if len(ids) < context:
        raise ConfigError(f"the calibration text has {len(ids)} tokens; at least {context} are needed")
    from tqdm import tqdm

    rec = RecordingOps(engine.ops, thresholded_weights(engine), engine.args.num_hidden_layers)
    starts = range(0, len(ids) - context + 1, context)
    with watching(engine, rec):
        for s in tqdm(starts, desc="calibrating thresholds", unit="window", disable=not progress, file=sys.stderr):
            caches = engine.new_caches()
            engine.forward(ids[s : s + context], caches)
            engine.release(caches)
    q = {r: np.stack([quantiles(c) for c in rec.counts[r]]) for r in ROLES}
    scored = len(starts) * context
    return Thresholds(q, store_fingerprint(engine.store), {"tokens": scored, "context": context})


STEP = 0.1  # how far the greedy search moves one input's level at a time
TOP = 0.9  # the highest level it gives an input


def role_params(args) -> dict[str, int]:
    """Weights each input feeds in the whole model: what a model-wide level weighs the inputs by."""
    d, f, hd = args.hidden_size, args.intermediate_size, args.head_dim
    heads, kv = args.num_attention_heads, args.num_key_value_heads
    per_layer = {"qkv": d * (heads + 2 * kv) * hd, "o": heads * hd * d, "gate_up": 2 * d * f, "down": f * d}
    return {r: n * args.num_hidden_layers for r, n in per_layer.items()}


CHECKED = (0.25, 0.4)  # model-wide levels at which the search's split must beat the uniform one


def greedy_allocation(
    engine, found: Thresholds, ids: list[int], check: list[int], progress: bool = True
) -> tuple[list, dict]:
    """TEAL's greedy allocation, taken model-wide: from every input dense, raise by STEP the level of
    the input whose step costs the least calibration loss (the log perplexity of `ids`, every row
    thresholded) per share of the model's weights it skips, until every input is at TOP. Then the
    split is checked on other text (`check`) at CHECKED levels against every input at the level: it is
    kept only where it loses less there, since a search on a few hundred tokens can fit them rather
    than the model. Returns (the points [model-wide level, {input: level}] for Thresholds.allocation,
    or [] for the uniform split; the check's losses). The engine's products are left thresholded:
    use it for nothing else."""
    from tqdm import tqdm

    products = threshold_products(engine.ops, engine.weights, engine.ffn, found, 0.0, SparsityRows.ALL)
    params = role_params(engine.args)
    total = sum(params.values())

    def wide(levels):
        return sum(levels[r] * params[r] for r in ROLES) / total

    def loss(levels, text_ids=ids) -> float:
        at = {r: found.quantiles[r][:, min(round(levels[r] * 100), PERCENTS - 1)] for r in ROLES}
        for layer, role, p in products:
            p.threshold = float(at[role][layer])
        return float(token_nlls(engine.logits(text_ids)[:-1], np.asarray(text_ids[1:])).mean())

    levels = dict.fromkeys(ROLES, 0.0)
    points, now = [[0.0, dict(levels)]], loss(levels)
    steps = round(TOP / STEP) * len(ROLES)
    with tqdm(total=steps, desc="allocating levels", unit="step", disable=not progress, file=sys.stderr) as bar:
        while any(levels[r] < TOP - 1e-9 for r in ROLES):
            best = None
            for r in ROLES:
                if levels[r] >= TOP - 1e-9:
                    continue
                trial = {**levels, r: round(levels[r] + STEP, 6)}
                cost = loss(trial)
                per_share = (cost - now) / (wide(trial) - wide(levels))
                if best is None or per_share < best[0]:
                    best = (per_share, trial, cost)
            _, levels, now = best
            points.append([round(wide(levels), 6), dict(levels)])
            bar.update(1)
    searched = Thresholds(found.quantiles, found.store, found.calibration, points)
    checked = {
        f"{level:g}": {
            "searched": loss(searched.role_levels(level), check),
            "uniform": loss(dict.fromkeys(ROLES, level), check),
        }
        for level in CHECKED
    }
    return points, checked


def search_wins(checked: dict) -> bool:
    """Whether the searched split lost less than the uniform one on the check's text: a search on a
    few hundred tokens can fit them rather than the model, so only a split that holds elsewhere is kept."""
    return sum(c["searched"] for c in checked.values()) < sum(c["uniform"] for c in checked.values())


def sparsity_thresholds(
    model: str | None = None,
    corpus: str = "austen",
    tokens: int = 8192,
    context: int = 512,
    progress: bool = True,
    precision: str = "auto",
    allocate: int = 512,
) -> str:
    """Measure a model's activation-sparsity thresholds on `corpus` (the Austen novels by default) and
    save them beside its store; returns the file's path. `load(model, sparsity=0.4)` then uses them.
    precision: the store's, as load() takes it (ffn="sparse" converts at "source-neuron": each store
    has thresholds of its own). allocate: tokens of the greedy search that shares a model-wide level
    among the inputs (greedy_allocation); 0: every input at the model-wide level."""
    with load(model, ffn="resident", progress=progress, precision=precision) as engine:
        return save_thresholds(engine.store, measure(engine, corpus, tokens, context, allocate, progress))


def measure(engine, corpus: str, tokens: int, context: int, allocate: int, progress: bool = True) -> Thresholds:
    """A dense, resident engine's thresholds on `corpus`: the quantiles over its first `tokens` tokens,
    then (allocate > 0) the greedy allocation over the `allocate` tokens after them, checked on the
    `allocate` tokens after those. The engine's products are left thresholded by the search: use it
    for nothing else."""
    text = read_corpus(corpus)
    found = calibrate(engine, text, tokens, context, progress)
    found.calibration["corpus"] = corpus
    if allocate:
        ids = engine.tokenizer.encode(text)[tokens : tokens + 2 * allocate]
        points, checked = greedy_allocation(engine, found, ids[:allocate], ids[allocate:], progress)
        found.allocation = points if search_wins(checked) else []
        found.calibration |= {
            "allocation_tokens": allocate,
            "allocation": "searched" if found.allocation else "uniform (the search's split lost on the check)",
            "allocation_check": checked,
        }
    return found
