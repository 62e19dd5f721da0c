"""The compute half of the cost model, measured: a few timed passes of one layer of the loaded
model (its real weights, this machine, this backend), fitted to ComputeSpeed. Takes well under a
second on the default model, a few seconds on a 7B-shape one. Reads are the disk profile's."""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..memory.process_plan import ModelShape
from ..batching.batch_cache import BatchKV
from ..models.cache import KVCache
from .cost_model import ComputeSpeed
from ..batching.schedule import LayerOnce


def _fit(xs, ys) -> tuple[float, float]:
    """(fixed, per unit) of a least-squares line through the points, both kept >= 0."""
    slope, icpt = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    slope = max(float(slope), 0.0)
    return max(float(icpt), 0.0), slope


def measure_compute(engine, prompt: int, context: int, max_rows: int, repeats: int = 3) -> ComputeSpeed:
    """Time layer 0 on random activations: prefill of 1 sequence at two lengths up to `prompt`, and
    a decode step of micro-batches of 1 and `max_rows` rows over `context` cached tokens."""
    ops, module, args, w = engine.ops, engine.module, engine.args, engine.weights
    shape = ModelShape.from_config(engine.store.config)
    rng = np.random.default_rng(0)
    ffn = LayerOnce(engine.ffn) if engine.ffn.same_for_every_input else engine.ffn
    lw = w["layers"][0]

    def act(rows, T):
        return ops.array((rng.standard_normal((rows, T, shape.d_model)) * 0.5).astype(np.float32))

    def timed(h, cache, keep: int) -> float:
        """Median seconds of layer 0 on h, the cache cut back to `keep` tokens before each run."""
        runs = []
        for _ in range(repeats):
            cache.trim(cache.offset - keep)
            t = time.perf_counter()
            ops.materialize(module.block(ops, args, lw, 0, h, cache, ffn))
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    def filled(m: int):
        """A batch of m rows, each holding `context` random cached tokens."""
        rows = []
        for _ in range(m):
            r = KVCache()
            kv = ops.array(rng.standard_normal((1, shape.kv_heads, context, shape.head_dim)).astype(np.float32))
            r.update(ops, kv, kv)
            rows.append(r)
        return BatchKV(rows)

    with ops.inference():
        timed(act(1, 1), KVCache(), 0)  # the first call fetches the FFN's weights and makes buffers
        lengths = sorted({max(1, prompt // 4), max(2, prompt)})
        pre = [timed(act(1, T), KVCache(), 0) for T in lengths]
        rows = sorted({1, max(1, max_rows)})
        dec = [timed(act(m, 1), filled(m), context) for m in rows]
    pf, pt = _fit(lengths, pre)
    df, dr = _fit(rows, dec) if len(rows) > 1 else (dec[0], 0.0)
    return ComputeSpeed(pre_fixed=pf, pre_per_token=pt, dec_fixed=df, dec_per_row=dr)
