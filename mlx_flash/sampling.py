"""Token sampling on host logits (numpy), identical for every backend."""

from __future__ import annotations

import numpy as np

from .errors import ConfigError


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0 (got {temperature})")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1] (got {top_p})")
    if top_k < 0:
        raise ConfigError(f"top_k must be >= 0 (got {top_k})")


def sample(logits: np.ndarray, temperature: float, top_p: float, top_k: int, rng: np.random.Generator) -> int:
    """Greedy when temperature == 0; otherwise temperature, then top-k, then nucleus (top-p)."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(p.size, p=p))


def partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
