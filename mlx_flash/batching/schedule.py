"""How a block of micro-batches walks the layers: FlexGen's zig-zag order, or one micro-batch at a
time (the baseline it beats).

A micro-batch is a group of rows that run as one batched call of the graph's pieces
(models.X.embed / block / head) with one `BatchKV` per layer. In `Order.ZIGZAG` (FlexGen §4.2, Fig.
3b) the block goes layer by layer: layer i's weights are fetched once, every micro-batch runs
through layer i, and only then layer i + 1, whose read the FFN reader and the layer slots started
when layer i was handed out (reading overlaps the block's compute on layer i). In `Order.ROW`
every micro-batch walks all layers before the next starts, so a streamed layer is read once per
micro-batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..ffn_source import LayerSource


class Order(enum.Enum):
    ZIGZAG = "zigzag"  # layer-major over the block's micro-batches: weights read once per layer
    ROW = "row"  # micro-batch-major: each micro-batch reads every streamed layer again


@dataclass
class MicroBatch:
    tokens: object  # backend int [B, T]
    caches: list  # one LayerKV (a BatchKV, or one sequence's cache) per layer
    all_logits: bool = False


class LayerOnce(LayerSource):
    """A dense FFN source asked once per layer: the block's micro-batches share layer i's weights
    (the wrapped source reads a streamed layer when first asked, and starts the next one's read)."""

    def __init__(self, inner: LayerSource):
        self.inner = inner
        self.i, self.w = None, None

    def layer(self, i: int, x):
        if i != self.i:
            self.i, self.w = i, None  # the previous layer's weights may view a buffer being refilled
            self.w = self.inner.layer(i, x)
        return self.w

    def stats(self):
        return self.inner.stats()


def run_block(engine, batches: list[MicroBatch], order: Order) -> list:
    """Run every micro-batch through the model; its logits [B, T or 1, vocab] as float32 numpy, one
    array per micro-batch, in order."""
    ops, module, args, w = engine.ops, engine.module, engine.args, engine.weights
    L = args.num_hidden_layers
    with ops.inference():
        if order is Order.ROW:
            out = []
            for mb in batches:
                mb.caches[0].prefetch()
                h = module.embed(ops, args, w, mb.tokens, mb.caches)
                for i in range(L):
                    if i + 1 < L:
                        mb.caches[i + 1].prefetch()  # a cache on flash reads ahead while layer i computes
                    h = module.block(ops, args, w["layers"][i], i, h, mb.caches[i], engine.ffn)
                    ops.materialize(h)
                out.append(ops.to_numpy(module.head(ops, args, w, h, mb.all_logits)))
            return out
        ffn = LayerOnce(engine.ffn) if engine.ffn.same_for_every_input else engine.ffn
        batches[0].caches[0].prefetch()
        hs = [module.embed(ops, args, w, mb.tokens, mb.caches) for mb in batches]
        for i in range(L):
            lw = w["layers"][i]  # a streamed layer: read now (if not read ahead), the next one's read started
            for k, mb in enumerate(batches):
                nxt = (
                    batches[k + 1].caches[i]
                    if k + 1 < len(batches)
                    else batches[0].caches[i + 1]
                    if i + 1 < L
                    else None
                )
                if nxt is not None:
                    nxt.prefetch()  # the next micro-batch's KV, if on flash, is read while this one computes
                hs[k] = module.block(ops, args, lw, i, hs[k], mb.caches[i], ffn)
                # computed now, so layer i's weights are done with before a read may refill their buffer and a
                # spilled micro-batch's keys are freed before the next one's arrive
                ops.materialize(hs[k])
        return [ops.to_numpy(module.head(ops, args, w, h, mb.all_logits)) for h, mb in zip(hs, batches)]
