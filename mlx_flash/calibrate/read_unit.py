"""What the sparse read unit costs in quality: a neuron (its own bundle; the down projection
re-quantized along d_model, precision "source-neuron") or a block of neurons (the source's bytes,
precision "source": a bundle holds one quantization group of neurons).

`OracleUnits` wraps a resident dense FFN and, per token and layer, keeps the `share` of read units
with the largest activation mass sum(|silu(gate)·up|) over the unit's neurons, zeroing every other
neuron: what a perfect selector reading that share of each layer's bytes computes. Comparing the two
stores at equal bytes read per token (share x layer bytes) separates the read unit's cost from any
predictor's errors. Offline only (python -m mlx_flash.bench read-unit); nothing per token uses it.
"""

from __future__ import annotations

import numpy as np

from ..ffn_source import FFNWeights, WrappedLayerSource


class OracleUnits(WrappedLayerSource):
    def __init__(self, inner, ops, module, args, block: int, share: float):
        super().__init__(inner)
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1] (got {share})")
        self.ops, self.module, self.args, self.block, self.share = ops, module, args, block, share

    def units_kept(self, n_units: int) -> int:
        return max(1, int(round(self.share * n_units)))

    def layer(self, i: int, x) -> FFNWeights:
        w = self.inner.layer(i, x)
        h = np.abs(self.ops.to_numpy(self.module.ffn_hidden(self.ops, self.args, w, x)).astype(np.float32))
        n, F = int(np.prod(h.shape[:-1])), h.shape[-1]
        mass = h.reshape(n, F // self.block, self.block).sum(2)
        k = self.units_kept(mass.shape[1])
        top = np.argpartition(-mass, k - 1, axis=1)[:, :k]
        keep = np.zeros_like(mass, dtype=np.float32)
        np.put_along_axis(keep, top, 1.0, axis=1)
        mask = np.repeat(keep, self.block, axis=1).reshape(*h.shape)
        return FFNWeights(down=w.down, gate_up=w.gate_up, up=w.up, mask=self.ops.array(mask))
