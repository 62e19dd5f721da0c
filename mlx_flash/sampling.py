"""Token sampling on host logits (numpy), identical for every backend."""

from __future__ import annotations

import math
import numbers
import reprlib

import numpy as np

from .errors import ConfigError


def shown(value) -> str:
    """A value for a one-line message: its repr, shortened (a huge int or list stays readable)."""
    return reprlib.repr(value)


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    check_real("temperature", temperature, low=0.0)
    check_real("top_p", top_p, low=0.0, high=1.0, open_low=True)
    check_int("top_k", top_k, low=0)


def check_generation(
    max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None, stop, speculative: int
) -> None:
    """Every option of generate() / stream_generate(), refused with its name before anything runs."""
    check_sampling(temperature, top_p, top_k)
    check_int("max_tokens", max_tokens, low=0)
    check_seed("seed", seed)
    stop_strings(stop)
    check_int("speculative", speculative, low=0)
    if speculative and temperature != 0:
        raise ConfigError(f"speculative decoding ({speculative} draft tokens) needs temperature 0 (got {temperature})")


def check_sampling_flags(temp: float, top_p: float, top_k: int, seed: int | None) -> None:
    """The command lines' sampling flags, refused by flag name before a model loads."""
    check_real("--temp", temp, low=0.0)
    check_real("--top-p", top_p, low=0.0, high=1.0, open_low=True)
    check_int("--top-k", top_k, low=0)
    check_seed("--seed", seed)


def check_real(name: str, value, low: float, high: float | None = None, open_low: bool = False) -> None:
    """A finite number in [low, high] ((low, high] with open_low). NaN and infinities are refused by
    name: NaN compares false with every bound, so range checks alone let it through."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number (got {shown(value)})")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number (got {shown(value)})")
    if value < low or (open_low and value == low) or (high is not None and value > high):
        bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ConfigError(f"{name} must be {'in ' if high is not None else ''}{bounds} (got {shown(value)})")


def check_int(name: str, value, low: int) -> None:
    """An integer >= low (a bool or a float with an integer value is refused: it is a mistake)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer >= {low} (got {shown(value)})")
    if value < low:
        raise ConfigError(f"{name} must be >= {low} (got {shown(value)})")


def check_seed(name: str, seed) -> None:
    """None (fresh entropy) or an integer >= 0, what numpy's generator takes."""
    if seed is not None:
        check_int(name, seed, low=0)


def stop_strings(stop) -> list[str]:
    """stop as a list of non-empty strings: None, one string, or a list/tuple of strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ConfigError(f"stop must be a string or a list of strings (got {shown(stop)})")
    return [s for s in stop if s]


def sample(logits: np.ndarray, temperature: float, top_p: float, top_k: int, rng: np.random.Generator) -> int:
    """Greedy when temperature == 0; otherwise temperature, then top-k, then nucleus (top-p)."""
    if temperature == 0:
        return int(np.argmax(logits))
    with np.errstate(over="ignore"):
        z = logits.astype(np.float64) / temperature
    if np.isposinf(z.max()):  # a temperature so small the top logit overflows: its limit is greedy
        return int(np.argmax(logits))
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
