"""Train a store's sparsity predictors from the real model's activations (calibration text in,
predictors saved into the store; tools/train_predictor.py). The predictors themselves, and what
inference does with them, are sparse/predictor.py: this file fits them (torch on the CPU), sets
their cuts and measures them."""

from __future__ import annotations

import numpy as np

from ..sparse.predictor import LayerPredictor, Predictors
from .activations import collect, magnitude_thresholds, window_activity


RECALLS = (0.8, 0.9, 0.95, 0.99)  # cuts are stored for each; load(flash=FlashOptions(recall=...)) picks one
VALID_CONTEXT = 512  # tokens per window of validation text, as the perplexity evaluation uses


def train_predictors(
    engine,
    calib_ids,
    valid_ids,
    sparsity: float = 0.5,
    rank: int = 64,
    max_rank: int = 256,
    recall: float = 0.9,
    calib_tokens: int = 16384,
    valid_tokens: int = 2048,
    epochs: int = 10,
    progress: bool = False,
    log=print,
) -> Predictors:
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
        Y = labels(H, thresholds[i])
        n = int(len(X) * 0.9)
        r = rank
        while True:
            p = train_layer(X[:n], Y[:n], r, epochs=epochs, seed=i)
            p.cut = calibrate_cut(p, X[n:], Y[n:], recall)
            held = evaluate(p, X[n:], Y[n:])
            if held["predicted_fraction"] <= (1 + held["true_fraction"]) / 2 or r * 2 > max_rank:
                break
            r *= 2
        Yv = labels(valid[i][1], thresholds[i])
        by_recall = {}
        for key in cuts:
            p.cut = calibrate_cut(p, X[n:], Y[n:], float(key))
            cuts[key].append(p.cut)
            by_recall[key] = evaluate(p, valid[i][0], Yv)
        p.cut = cuts[f"{recall:g}"][-1]
        m = dict(by_recall[f"{recall:g}"], rank=r, by_recall=by_recall)
        metrics.append(m)
        layers.append(p)
        if log:
            log(
                f"layer {i:2d}: rank {r:3d}  recall {m['recall']:.3f}  precision {m['precision']:.3f}  "
                f"predicted {m['predicted_fraction']:.3f}  true {m['true_fraction']:.3f}"
            )
    activity = window_activity([h for _, h in valid], thresholds, VALID_CONTEXT)
    return Predictors(layers, sparsity, [float(t) for t in thresholds], metrics, "", cuts, f"{recall:g}", activity)


def summarize(metrics: list[dict]) -> dict:
    keys = ("recall", "precision", "predicted_fraction", "true_fraction")
    return {k: float(np.mean([m[k] for m in metrics])) for k in keys}


def measure_activity(engine, preds: Predictors, valid_ids, valid_tokens: int = 2048, progress: bool = False) -> dict:
    """Window statistics of the labelled activity on validation text, for predictors trained before
    they were recorded (no retraining: the thresholds define the activity)."""
    valid = collect(engine, valid_ids, VALID_CONTEXT, valid_tokens, progress)
    return window_activity([h for _, h in valid], preds.magnitude_thresholds, VALID_CONTEXT)


def labels(mags: np.ndarray, threshold: float) -> np.ndarray:
    return mags.astype(np.float32) > threshold


def train_layer(
    X: np.ndarray, Y: np.ndarray, rank: int, epochs: int = 20, batch: int = 512, lr: float = 3e-3, seed: int = 0
) -> LayerPredictor:
    """Fit U, V, b with a balanced binary cross-entropy: positives weighted by negatives/positives
    per neuron, so rare and common neurons both count (the paper's balanced loss)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    Xt, Yt = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32)), torch.from_numpy(Y.astype(np.float32))
    D, F = X.shape[1], Y.shape[1]
    pos = Yt.mean(0).clamp(1e-3, 1 - 1e-3)
    pos_weight = (1 - pos) / pos
    U = torch.nn.Parameter(torch.randn(D, rank, generator=g) / D**0.5)
    V = torch.nn.Parameter(torch.randn(rank, F, generator=g) / rank**0.5)
    b = torch.nn.Parameter(torch.log(pos / (1 - pos)).clone())
    opt = torch.optim.Adam([U, V, b], lr=lr)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    steps = max(1, epochs * (len(Xt) // batch))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(epochs):
        perm = torch.randperm(len(Xt), generator=g)
        for s in range(0, len(Xt) - batch + 1 if len(Xt) >= batch else 1, batch):
            idx = perm[s : s + batch]
            loss = loss_fn((Xt[idx] @ U) @ V + b, Yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return LayerPredictor(U.detach().numpy().copy(), V.detach().numpy().copy(), b.detach().numpy().copy())


def calibrate_cut(p: LayerPredictor, X: np.ndarray, Y: np.ndarray, recall: float) -> float:
    """The highest logit cut whose recall on (X, Y) is at least `recall`."""
    z = p.logits(X)
    pos = z[Y]
    if pos.size == 0:
        return float(z.max())
    at = np.float32(np.quantile(pos, 1.0 - recall, method="lower"))
    return float(np.nextafter(at, np.float32(-np.inf)))  # just below, so `logit > cut` keeps it


def evaluate(p: LayerPredictor, X: np.ndarray, Y: np.ndarray) -> dict:
    pred = p.active(X)
    tp = float((pred & Y).sum())
    return {
        "recall": tp / max(1.0, float(Y.sum())),
        "precision": tp / max(1.0, float(pred.sum())),
        "predicted_fraction": float(pred.mean()),
        "true_fraction": float(Y.mean()),
    }
