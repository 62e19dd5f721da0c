"""Plain-ops references of the CPU pointwise kernels (cpu/pointwise.cpp), in float64 with numpy."""

from __future__ import annotations

import numpy as np


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def rope_ref(
    x: np.ndarray, inv_freq: np.ndarray, pos: np.ndarray, dims: int, traditional: bool, scale: float
) -> np.ndarray:
    """x [B, H, T, hd]: token t of row b turns pair i by (pos[b] + t) * scale * inv_freq[i]; pairs
    interleaved (traditional) or halves; features past dims unchanged."""
    B, H, T, hd = x.shape
    y = x.astype(np.float64).copy()
    ang = ((np.asarray(pos)[:, None] + np.arange(T)[None, :]) * scale)[:, None, :, None] * inv_freq.astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    if traditional:
        a, b = x[..., 0:dims:2].astype(np.float64), x[..., 1:dims:2].astype(np.float64)
        y[..., 0:dims:2], y[..., 1:dims:2] = a * c - b * s, a * s + b * c
    else:
        half = dims // 2
        a, b = x[..., :half].astype(np.float64), x[..., half:dims].astype(np.float64)
        y[..., :half], y[..., half:dims] = a * c - b * s, a * s + b * c
    return y


def silu_mul_ref(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g = g.astype(np.float64)
    return g / (1 + np.exp(-g)) * u


def gated_ffn_ref(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """down(silu(gate) * up) of x [T, K], from dense weights: gate|up [2F, K] (gate first), down
    [D, F] (rows are outputs); float64."""
    h = x.astype(np.float64) @ gate_up.astype(np.float64).T
    F = h.shape[-1] // 2
    return silu_mul_ref(h[..., :F], h[..., F:]) @ down.astype(np.float64).T


def moe_experts_ref(x: np.ndarray, ids: np.ndarray, wts: np.ndarray, experts: dict) -> np.ndarray:
    """A MoE layer's routed experts from dense weights: x [N, D], ids / wts [N, K], experts: id ->
    (gate|up [2F, D], down [Dout, F]); each token's sum of its experts' gated FFN times their weights
    (float64)."""
    y = None
    for t in range(len(x)):
        for e, w in zip(ids[t], wts[t]):
            out = gated_ffn_ref(x[t : t + 1], *experts[int(e)])[0] * float(w)
            y = np.zeros((len(x), out.shape[-1])) if y is None else y
            y[t] += out
    return y
