"""The quality cost of KV chunk compression (service/compression.py) on long real text.

A window of `context` tokens is fed as a service context would hold it: in turns of `turn` tokens
into a chunked cache, and after each turn every complete chunk not yet compressed is compressed as
the service compresses chunks it writes (the widths chosen from the attention mass measured so
far, the chunk replaced by what it reads back as). Every token but the window's first is scored,
so later tokens see earlier chunks at their compressed widths. Windows start from an empty cache.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from ..service.chunk_pool import ChunkPool, ChunkShape
from ..service.chunked_kv import ChunkTable
from ..service.coded_chunks import packed_bytes
from ..service.compression import Compression, DensityTracker, choose_widths, lossy
from .perplexity_eval import token_nlls


def kv_quality(
    engine,
    ids: list[int],
    compression: Compression,
    context: int = 2048,
    turn: int = 128,
    chunk_tokens: int = 16,
    progress: bool = False,
) -> dict:
    """Perplexity of ids (windows of `context` tokens) with the KV compressed as `compression`,
    the greedy next-token picks (for agreement with another run), and the widths used."""
    if context < 2 or turn < 1:
        raise ConfigError("context must be >= 2 and turn >= 1")
    a = engine.args
    shape = ChunkShape(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, chunk_tokens)
    pool = ChunkPool(engine.ops, shape, -(-context // chunk_tokens))
    from tqdm import tqdm

    nll, picks, widths_all = [], [], []
    starts = [s for s in range(0, len(ids) - 1, context) if len(ids[s : s + context]) >= 2]
    for s in tqdm(starts, desc=f"KV {compression}", unit="window", disable=not progress):
        window = ids[s : s + context]
        table = ChunkTable(pool, density=DensityTracker() if compression.needs_density else None)
        widths: dict[int, int] = {}
        for t in range(0, len(window) - 1, turn):
            piece = window[t : t + turn]
            caches = table.caches()
            logits = engine.forward(piece, caches, all_logits=True)
            table.tokens = caches[0].offset
            targets = np.asarray(window[t + 1 : t + 1 + len(piece)])
            nll.append(token_nlls(logits[: len(targets)], targets))
            picks.append(logits[: len(targets)].argmax(-1))
            n = table.tokens // chunk_tokens
            fresh = [i for i in range(n) if i not in widths]
            if compression.on and fresh:
                slots = [table.slots[i] for i in fresh]
                data = pool.export(slots)
                dens = table.density.chunk_density(chunk_tokens, n) if table.density is not None else None
                chosen = choose_widths(compression, dens, widths, dict(zip(fresh, data)))
                pool.load(slots, np.stack([lossy(x, chosen[i]) for i, x in zip(fresh, data)]))
                widths.update(chosen)
        widths_all += list(widths.values())
        table.truncate(0)
    nll = np.concatenate(nll)
    mean_bits = float(np.mean(widths_all)) if widths_all else 32.0
    stored = (
        sum(packed_bytes(shape.array_shape, w) for w in widths_all) / (len(widths_all) * shape.nbytes)
        if widths_all
        else 1.0
    )
    return {
        "compression": str(compression),
        "perplexity": math.exp(float(nll.mean())),
        "scored": int(nll.size),
        "picks": np.concatenate(picks),
        "mean_bits": mean_bits,
        "bytes_vs_float32": stored,
        "widths": {w: widths_all.count(w) for w in sorted(set(widths_all))},
    }
