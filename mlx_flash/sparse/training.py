"""Train a store's sparsity predictors from the real model's activations (calibration text in,
predictors saved into the store). Used by tools/train_predictor.py."""

from __future__ import annotations

import numpy as np

from . import predictor as P
from .activations import collect, magnitude_thresholds, window_activity


RECALLS = (0.8, 0.9, 0.95, 0.99)  # cuts are stored for each; load(predictor_recall=...) picks one
VALID_CONTEXT = 512  # tokens per window of validation text, as the perplexity evaluation uses


def train_predictors(engine, calib_ids, valid_ids, sparsity: float = 0.5, rank: int = 64, max_rank: int = 256,
                     recall: float = 0.9, calib_tokens: int = 16384, valid_tokens: int = 2048, epochs: int = 10,
                     progress: bool = False, log=print) -> P.Predictors:
    """Per layer: label (token, neuron) pairs active when |h| exceeds the layer's threshold for the
    target sparsity; fit a rank-`rank` predictor on 90% of the calibration activations; set its cut
    for `recall` on the other 10%; if that recall costs predicting more than (1 + the true active
    fraction) / 2 of the neurons, retry at twice the rank up to `max_rank` (layers that need more
    capacity get it, Appendix B). Metrics are measured on the validation text."""
    from tqdm import tqdm

    train = collect(engine, calib_ids, 256, calib_tokens, progress)
    valid = collect(engine, valid_ids, VALID_CONTEXT, valid_tokens, progress)
    thresholds = magnitude_thresholds([h for _, h in train], sparsity)
    layers, metrics = [], []
    cuts = {f"{r:g}": [] for r in sorted(set(RECALLS) | {recall})}
    for i in tqdm(range(len(train)), desc="predictors", unit="layer", disable=not progress):
        X, H = train[i]
        Y = P.labels(H, thresholds[i])
        n = int(len(X) * 0.9)
        r = rank
        while True:
            p = P.train_layer(X[:n], Y[:n], r, epochs=epochs, seed=i)
            p.cut = P.calibrate_cut(p, X[n:], Y[n:], recall)
            held = P.evaluate(p, X[n:], Y[n:])
            if held["predicted_fraction"] <= (1 + held["true_fraction"]) / 2 or r * 2 > max_rank:
                break
            r *= 2
        Yv = P.labels(valid[i][1], thresholds[i])
        by_recall = {}
        for key in cuts:
            p.cut = P.calibrate_cut(p, X[n:], Y[n:], float(key))
            cuts[key].append(p.cut)
            by_recall[key] = P.evaluate(p, valid[i][0], Yv)
        p.cut = cuts[f"{recall:g}"][-1]
        m = dict(by_recall[f"{recall:g}"], rank=r, by_recall=by_recall)
        metrics.append(m)
        layers.append(p)
        if log:
            log(f"layer {i:2d}: rank {r:3d}  recall {m['recall']:.3f}  precision {m['precision']:.3f}  "
                f"predicted {m['predicted_fraction']:.3f}  true {m['true_fraction']:.3f}")
    activity = window_activity([h for _, h in valid], thresholds, VALID_CONTEXT)
    return P.Predictors(layers, sparsity, [float(t) for t in thresholds], metrics, "", cuts, f"{recall:g}", activity)


def summarize(metrics: list[dict]) -> dict:
    keys = ("recall", "precision", "predicted_fraction", "true_fraction")
    return {k: float(np.mean([m[k] for m in metrics])) for k in keys}


def measure_activity(engine, preds: P.Predictors, valid_ids, valid_tokens: int = 2048, progress: bool = False) -> dict:
    """Window statistics of the labelled activity on validation text, for predictors trained before
    they were recorded (no retraining: the thresholds define the activity)."""
    valid = collect(engine, valid_ids, VALID_CONTEXT, valid_tokens, progress)
    return window_activity([h for _, h in valid], preds.magnitude_thresholds, VALID_CONTEXT)
