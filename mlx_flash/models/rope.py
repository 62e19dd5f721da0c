"""RoPE frequency scalings beyond a plain base (Llama 3.x's "llama3", YaRN's "yarn", and "factors": the
per-pair divisors a Llama 3.x GGUF carries as its rope_freqs tensor), as numbers the
graph hands to ops.rope once per model: the inverse frequency of each rotated pair of features and
an attention factor that multiplies the rotated queries and keys (YaRN's mscale; 1 otherwise).

Both follow the published definitions (Llama 3.1's release code; the YaRN paper, arXiv 2309.00071,
with the defaults transformers uses: beta_fast 32, beta_slow 1, a truncated correction range, the
attention factor 0.1 ln(factor) + 1). "linear" scaling stays a position scale (ModelArgs.rope_scale).
"""

from __future__ import annotations

import functools
import math

import numpy as np

SCALINGS = ("linear", "llama3", "yarn", "factors")


def plain_inverse_frequencies(dims: int, base: float) -> np.ndarray:
    return 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)


def frequencies_key(dims: int, base: float, freqs=None) -> tuple:
    """What names kernel_inverse_frequencies' result: a backend keeps its array per key, so a decode
    step converts nothing."""
    return dims, float(base), None if freqs is None else np.asarray(freqs).tobytes()


def kernel_inverse_frequencies(dims: int, base: float, freqs=None) -> np.ndarray:
    """Each rotary pair's inverse frequency as contiguous float32 [dims / 2] (what the CPU rope kernel
    takes): `freqs` as a scaling gave it, else base^(-2i / dims)."""
    return np.ascontiguousarray(plain_inverse_frequencies(dims, base) if freqs is None else freqs, dtype=np.float32)


def llama3_inverse_frequencies(dims: int, base: float, s: dict) -> np.ndarray:
    """Long wavelengths (beyond the original context / low_freq_factor) slowed by `factor`, short
    ones (below it / high_freq_factor) kept, those between blended smoothly."""
    inv = plain_inverse_frequencies(dims, base)
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, blended, scaled)


def yarn_inverse_frequencies(dims: int, base: float, s: dict, max_positions: int) -> tuple[np.ndarray, float]:
    """Interpolated (divided by `factor`) below the correction range of dimensions, extrapolated
    (kept) above it, a linear ramp between; and the attention factor."""
    factor = float(s.get("factor") or max_positions / float(s["original_max_position_embeddings"]))
    old = float(s.get("original_max_position_embeddings") or max_positions)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations):
        return dims * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dims - 1)
    if lo == hi:
        hi += 0.001  # a ramp of zero width
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
    pos = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    keep = 1 - ramp  # the share of each pair left unscaled
    inv = (1 / (factor * pos)) * (1 - keep) + (1 / pos) * keep

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inv, float(attention)


def rope_frequencies(
    dims: int, base: float, scaling: dict | None, max_positions: int
) -> tuple[np.ndarray | None, float]:
    """(inverse frequencies [dims / 2] or None for plain RoPE, attention factor) of a normalized
    config's `rope_scaling` (models/llama.py normalize_config); worked out once per model (the
    graph asks every layer and step)."""
    if not scaling:
        return None, 1.0
    key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))  # hashable
    return _frequencies(dims, base, key, max_positions)


@functools.lru_cache(maxsize=16)
def _frequencies(dims: int, base: float, items: tuple, max_positions: int):
    scaling = dict(items)
    kind = scaling.get("rope_type")
    if kind == "llama3":
        return llama3_inverse_frequencies(dims, base, scaling), 1.0
    if kind == "yarn":
        return yarn_inverse_frequencies(dims, base, scaling, max_positions)
    if kind == "factors":  # each pair's frequency divided by its factor (a GGUF's rope_freqs tensor)
        return plain_inverse_frequencies(dims, base) / np.asarray(scaling["factors"], np.float64), 1.0
    return None, 1.0
