"""Calibration data for sparsity: run the real model over text and record, per layer, the FFN input
x (the normed residual that feeds the FFN) and the magnitude of each neuron's activation |h| (for
SwiGLU h = silu(gate) * up; for ReLU/GELU FFNs h = act(up)). Numpy out; the model runs unchanged."""

from __future__ import annotations

import numpy as np

from ..ffn_source import WrappedLayerSource


class RecordingFFN(WrappedLayerSource):
    """Wraps an FFN source and keeps (x, |h|) of every position it is called with."""

    def __init__(self, inner, ops, module, args):
        super().__init__(inner)
        self.ops, self.module, self.args = ops, module, args
        self.x: list[list[np.ndarray]] = [[] for _ in range(args.num_hidden_layers)]
        self.h: list[list[np.ndarray]] = [[] for _ in range(args.num_hidden_layers)]

    def layer(self, i: int, x):
        fw = self.inner.layer(i, x)
        h = self.module.ffn_hidden(self.ops, self.args, fw, x)
        d = x.shape[-1]
        self.x[i].append(self.ops.to_numpy(x).reshape(-1, d).astype(np.float32))
        self.h[i].append(np.abs(self.ops.to_numpy(h).reshape(-1, h.shape[-1])).astype(np.float16))
        return fw


def collect(engine, ids: list[int], context: int = 256, max_tokens: int = 8192, progress: bool = False):
    """Per layer (X [N, D] float32, |H| [N, F] float16) over the first max_tokens of `ids`, fed in
    independent windows of `context` tokens (like the perplexity evaluation)."""
    from tqdm import tqdm

    ids = list(ids)[:max_tokens]
    rec = RecordingFFN(engine.ffn, engine.ops, engine.module, engine.args)
    inner, engine.ffn = engine.ffn, rec
    try:
        for s in tqdm(range(0, len(ids), context), desc="activations", unit="window", disable=not progress):
            window = ids[s : s + context]
            if window:
                engine.forward(window, engine.new_caches(), all_logits=True)
    finally:
        engine.ffn = inner
    return [(np.concatenate(xs), np.concatenate(hs)) for xs, hs in zip(rec.x, rec.h)]


def magnitude_thresholds(mags: list[np.ndarray], sparsity: float) -> np.ndarray:
    """Per layer, the |h| below which a `sparsity` fraction of (token, neuron) activations fall:
    neurons above it are 'active' (CATS-style calibrated threshold)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1) (got {sparsity})")
    return np.array(
        [float(np.quantile(m.astype(np.float32), sparsity)) if sparsity > 0 else 0.0 for m in mags], dtype=np.float32
    )


def window_activity(mags: list[np.ndarray], thresholds, context: int, kmax: int = 8) -> dict:
    """How a window of k tokens behaves on this text, for k = 1..kmax, averaged over layers and
    positions: 'union' = share of neurons active in the last k tokens (the rows a window of k keeps
    cached), 'new' = share active now and in none of the k tokens before (the rows it reads per
    token). Positions restart every `context` tokens, as collected. The planner turns these into a
    window size through the cost model."""
    union, new, n = np.zeros(kmax), np.zeros(kmax), 0
    for m, t in zip(mags, thresholds):
        for s in range(0, len(m), context):
            A = m[s : s + context].astype(np.float32) > t  # [T, F]
            T = A.shape[0]
            if T <= kmax:
                continue
            now, prev = A[kmax:], np.zeros_like(A[kmax:])  # prev: union of the k tokens before
            for k in range(1, kmax + 1):
                union[k - 1] += (now | prev).mean()
                prev |= A[kmax - k : T - k]
                new[k - 1] += (now & ~prev).mean()
            n += 1
    n = max(n, 1)
    return {"union": (union / n).tolist(), "new": (new / n).tolist()}
