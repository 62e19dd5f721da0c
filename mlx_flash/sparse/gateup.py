"""The paper's alternative predictor, for gated FFNs (SwiGLU, GeGLU): the FFN's own gate (and up)
projection, kept resident in 4 bits. A neuron is active when |act(x·gate)·(x·up)| exceeds its
layer's calibrated threshold, the same definition the low-rank predictors are trained on, so this
is the selection they approximate. When the store's gate/up rows are 4-bit already (the default GGUF store) the
resident copy is the model's own weights and the selection is exact; for float rows it is the
4-bit rounding of them. Selected neurons are then computed from their streamed rows as stored.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..ffn_source import FFNWeights
from ..quant_spec import QuantSpec
from ..weights import fused_weight, linear_parts, neuron_arrays
from .selectors import Selection
from ..kernels.gguf_blocks_ref import dequantize

GROUP = 32


def quantize4(w: np.ndarray, group: int = GROUP) -> dict:
    """Affine 4-bit codes of w [N, K] per group of `group` values (scale = range / 15, bias = min), in
    the packed layout the backends read (8 codes per uint32, first code in the low bits). Weights that
    already sit on such a grid (a dequantized Q4_1 tensor) come back exactly, which mx.quantize does not
    promise (it may move the grid)."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // group, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = (hi - lo) / 15.0
    q = np.where(scale > 0, np.rint((g - lo) / np.where(scale > 0, scale, 1.0)), 0).clip(0, 15).astype(np.uint32)
    q = q.reshape(n, k // 8, 8)
    packed = np.zeros((n, k // 8), dtype=np.uint32)
    for j in range(8):
        packed |= q[:, :, j] << np.uint32(4 * j)
    return {"weight": packed, "scales": scale[..., 0].astype(np.float16), "biases": lo[..., 0].astype(np.float16)}


def _four_bit(parts: dict, dtypes: dict, quant: QuantSpec | None):
    """(parts, dtypes, spec) of a 4-bit copy of one stored linear; 4-bit rows pass through as stored."""
    if quant is not None and quant.bits == 4:
        return parts, dtypes, quant
    w = parts["weight"]
    if quant is not None and quant.is_block:  # GGUF block types: their values, then 4 bits
        w = dequantize(np.asarray(w), quant.kind)
    elif quant is not None:  # other bit widths: back to floats first
        import mlx.core as mx

        w = np.array(
            mx.dequantize(
                mx.array(w),
                mx.array(parts["scales"]),
                mx.array(parts["biases"]),
                group_size=quant.group_size,
                bits=quant.bits,
            ).astype(mx.float32)
        )
    elif dtypes["weight"] == "bfloat16":
        w = (w.astype(np.uint32) << 16).view(np.float32)
    out = quantize4(np.asarray(w, dtype=np.float32))
    return out, {"weight": "uint32", "scales": "float16", "biases": "float16"}, QuantSpec(bits=4, group_size=GROUP)


class GateUpSelector:
    def __init__(self, ops, module, args, layout, reader, thresholds, progress: bool = False):
        from tqdm import tqdm

        if not layout.gated:
            raise ConfigError(
                "predictor 'gate' needs a gated (SwiGLU, GeGLU) FFN; this model's FFN has no gate "
                "projection (use 'lowrank' or 'dense')"
            )
        self.ops, self.module, self.args = ops, module, args
        self.thresholds = np.asarray(thresholds, dtype=np.float32)
        self.weights = []
        for i in tqdm(range(len(layout.layer_offsets)), desc="gate/up predictor", unit="layer", disable=not progress):
            arrays = neuron_arrays(layout, reader.read_layer(i))[0]
            members, quants = [], []
            for role in ("gate", "up"):
                parts, dts = linear_parts(arrays, role)
                parts, dts, q = _four_bit(parts, dts, layout.quant_of(i).get(role))
                members.append((parts, dts))
                quants.append(q)
            w = fused_weight(ops, members, quants)
            self.weights.append(tuple(map(ops.matmul_only, w)) if isinstance(w, tuple) else ops.matmul_only(w))

    def select(self, layer: int, x) -> Selection:
        """x: the FFN input as the backend holds it; its activations stay there for the graph."""
        h = self.module.ffn_hidden(self.ops, self.args, FFNWeights(down=None, gate_up=self.weights[layer]), x)
        hn = self.ops.to_numpy(h)
        return Selection(np.abs(hn.reshape(-1, hn.shape[-1])) > self.thresholds[layer], hidden=h)
