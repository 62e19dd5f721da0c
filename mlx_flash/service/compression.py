"""Tolerance-aware KV chunk compression (LLMS §3.2): an approximation, off by default.

Option values (`kv_compression`, chosen once per service):
  off             exact: chunks keep the activation dtype in memory and float32 on flash
  static:B        every complete chunk at B bits (8, 4 or 2)
  tolerance:R     chunks at 8, 4 or 2 bits so their mean width is at most R x 8 bits (R = 0.5:
                  4 bits on average, the bytes of static:4); the bits go where attention mass times
                  quantization error is largest (assign_widths)

Information density of a chunk (the paper's Eq. 1): each token's attention column mean (the mass it
receives over the queries that can see it), averaged over layers, heads and the chunk's tokens.
The graph reports each layer's column sums through the cache protocol (LayerKV.observe) on prompt
passes (a decode step's one query would read every compressed chunk back to floats, every step);
the tracker keeps them per token. Quantization is group-wise affine (float16 scale and bias per group):
keys per channel over the chunk's tokens, values per token in groups of GROUP along the head
dimension, applied when a complete chunk is first written to flash: the
swap file holds the codes, and the chunk in memory is replaced by its dequantized values, so a
context computes the same whether or not it was swapped since. A chunk's width, once chosen, stays.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from ..errors import ConfigError
from .coded_chunks import WIDTHS, decode, encode


class Scheme(Enum):
    OFF = "off"
    STATIC = "static"
    TOLERANCE = "tolerance"


@dataclass(frozen=True)
class Compression:
    scheme: Scheme = Scheme.OFF
    bits: int = 0  # static
    ratio: float = 0.0  # tolerance: mean width / 8

    @classmethod
    def parse(cls, value) -> "Compression":
        if value is None or value == "off":
            return cls()
        if isinstance(value, Compression):
            return value
        if isinstance(value, str) and ":" in value:
            kind, _, arg = value.partition(":")
            try:
                if kind == "static" and int(arg) in WIDTHS:
                    return cls(Scheme.STATIC, bits=int(arg))
                if kind == "tolerance" and 2 / 8 <= float(arg) <= 1:
                    return cls(Scheme.TOLERANCE, ratio=float(arg))
            except ValueError:
                pass
        raise ConfigError(
            f"kv_compression {value!r} is not understood (off, static:8|4|2, or tolerance:R "
            "with R from 0.25 to 1, e.g. tolerance:0.5)"
        )

    @property
    def on(self) -> bool:
        return self.scheme is not Scheme.OFF

    @property
    def needs_density(self) -> bool:
        """Whether chunks' attention mass must be measured (tolerance-aware widths)."""
        return self.scheme is Scheme.TOLERANCE

    def __str__(self) -> str:
        return {Scheme.OFF: "off", Scheme.STATIC: f"static:{self.bits}", Scheme.TOLERANCE: f"tolerance:{self.ratio:g}"}[
            self.scheme
        ]


# ---- information density -----------------------------------------------------------------------------
class DensityTracker:
    """Per token of one sequence: attention mass received and how many (layer, head, query) rows
    could attend to it, accumulated over every pass."""

    def __init__(self):
        self.mass = np.zeros(0, np.float64)
        self.rows = np.zeros(0, np.float64)

    def add(self, columns: np.ndarray, n_queries: int, heads: int) -> None:
        """One layer's column sums [S] for the last n_queries queries (causal: query t of the pass
        sees keys up to S - n_queries + t)."""
        S = columns.shape[0]
        if self.mass.shape[0] < S:
            grow = S - self.mass.shape[0]
            self.mass = np.concatenate([self.mass, np.zeros(grow)])
            self.rows = np.concatenate([self.rows, np.zeros(grow)])
        self.mass[:S] += columns
        first = S - n_queries  # keys before the pass's first query are seen by every query
        seen = np.full(S, float(n_queries))
        seen[first:] = n_queries - np.arange(S - first)
        self.rows[:S] += heads * seen

    def truncate(self, n_tokens: int) -> None:
        self.mass, self.rows = self.mass[:n_tokens], self.rows[:n_tokens]

    def chunk_density(self, chunk_tokens: int, n_chunks: int) -> np.ndarray:
        """D_i of the first n_chunks chunks: mean over their tokens of mass / rows."""
        n = n_chunks * chunk_tokens
        mass = np.pad(self.mass[:n], (0, max(0, n - self.mass.shape[0])))
        rows = np.pad(self.rows[:n], (0, max(0, n - self.rows.shape[0])))
        tok = np.divide(mass, rows, out=np.zeros(n), where=rows > 0)
        return tok.reshape(n_chunks, chunk_tokens).mean(axis=1)


def attention_columns_ref(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """Plain-numpy reference of ops.attention_columns: q [1, Hq, T, hd], k [1, Hkv, S, hd] -> [S]."""
    _, Hq, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = np.zeros(S, np.float64)
    for h in range(Hq):
        s = q[0, h].astype(np.float64) @ k[0, h // (Hq // Hkv)].astype(np.float64).T * scale
        s = np.where(np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out += (p / p.sum(axis=1, keepdims=True)).sum(axis=0)
    return out


# ---- widths ----------------------------------------------------------------------------------------
def assign_widths(density: np.ndarray, errors: np.ndarray, budget_bits: float) -> list[int]:
    """Widths (8/4/2) for chunks of attention mass `density` [m] whose squared quantization error
    at each width is `errors` [m, 3] (WIDTHS order), with at most budget_bits in all: the widths
    minimising sum(D_i * error_i(w_i)), found exactly by a knapsack over 2-bit units. A chunk that
    receives more attention is worth its bits more; a chunk whose values quantize well needs fewer."""
    m = density.shape[0]
    units = [w // 2 for w in WIDTHS]
    U = int(budget_bits // 2)
    if U < m * min(units):
        return [min(WIDTHS)] * m
    U = min(U, m * max(units))
    cost = density[:, None] * errors  # [m, 3]
    best = np.full(U + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((m, U + 1), np.int8)
    for i in range(m):
        nxt = np.full(U + 1, np.inf)
        for j, u in enumerate(units):
            if u > U:
                continue
            cand = np.full(U + 1, np.inf)
            cand[u:] = best[: U + 1 - u] + cost[i, j]
            take = cand < nxt
            nxt[take], choice[i, take] = cand[take], j
        best = nxt
    u = int(np.argmin(best))
    out = [0] * m
    for i in range(m - 1, -1, -1):
        j = int(choice[i, u])
        out[i] = WIDTHS[j]
        u -= units[j]
    return out


def choose_widths(
    c: Compression, density: np.ndarray | None, fixed: dict[int, int], fresh: dict[int, np.ndarray]
) -> dict[int, int]:
    """Widths for the chunks `fresh` (index -> float32 data; complete, not compressed yet) of a
    sequence whose complete chunks have `density` and whose compressed chunks have the widths
    `fixed`: static, or tolerance-aware so that fixed and fresh chunks together average at most
    ratio x 8 bits."""
    if not fresh or not c.on:
        return {}
    if c.scheme is Scheme.STATIC:
        return {i: c.bits for i in fresh}
    idx = list(fresh)
    errors = np.array([[float(np.square(x - lossy(x, w)).sum()) for w in WIDTHS] for x in fresh.values()])
    budget = c.ratio * 8 * (len(fixed) + len(idx)) - sum(fixed.values())
    return dict(zip(idx, assign_widths(density[idx], errors, budget)))


def lossy(x: np.ndarray, bits: int) -> np.ndarray:
    """What a chunk holds once compressed to `bits` and read back."""
    return decode(np.frombuffer(encode(x, bits), np.uint8), x.shape, bits)
