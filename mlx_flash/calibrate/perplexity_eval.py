"""Perplexity of a model on a text: non-overlapping windows of `context` tokens, each scored from an
empty cache (every token but a window's first is predicted), over the first `max_tokens` tokens."""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from ..offload.quantized_kv import make_row_caches
from ..offload.sparse_attention import with_top_k


def token_nlls(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under float64 log-softmax of its logits row."""
    z = logits.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    logz = np.log(np.exp(z).sum(-1))
    return logz - z[np.arange(len(targets)), targets]


def perplexity(
    engine,
    text: str,
    context: int = 512,
    max_tokens: int = 4096,
    progress: bool = False,
    kv_bits: int = 0,
    attention_keep: float = 1.0,
) -> dict:
    """kv_bits 4: every window's KV cache held at 4 bits, as the throughput mode's policy.kv_bits
    holds it (offload/quantized_kv.py); attention_keep < 1: top-k sparse attention, as its
    policy.attention_keep (offload/sparse_attention.py), every query keeping that share of the keys
    it sees. Both to measure those approximations' cost."""
    if context < 2:
        raise ConfigError(f"context must be >= 2 (got {context})")
    ids = engine.tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ConfigError("the text has fewer than 2 tokens")
    from tqdm import tqdm

    nll, count = 0.0, 0
    starts = range(0, len(ids) - 1, context)
    for s in tqdm(starts, desc="perplexity", unit="window", disable=not progress):
        window = ids[s : s + context]
        if len(window) < 2:
            break
        if kv_bits or attention_keep < 1.0:
            caches = with_top_k(make_row_caches(engine, kv_bits, len(window)), attention_keep)
            logits = engine.prefill(window, caches, all_logits=True)
        else:
            logits = engine.logits(window)
        nll += float(token_nlls(logits[:-1], np.asarray(window[1:])).sum())
        count += len(window) - 1
    return {
        "perplexity": math.exp(nll / count),
        "nll": nll / count,
        "tokens": len(ids),
        "scored": count,
        "context": context,
        "kv_bits": kv_bits,
        "attention_keep": attention_keep,
    }
