"""The sparse FFN of the MLX backend, as methods of MLXOps: which member of the sparse kernels runs
(Metal on Apple silicon, the CPU kernel's primitives elsewhere) and a decode step over a slab."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..ffn_source import GateActivation
from ..kernels import mlx_kernels
from ..kernels.metal_sparse import MetalSparseFFN
from ..kernels.sparse_ffn import CpuSparseFFN
from . import slab_operators


def sparse_kernel(self, spec, act: GateActivation):
    """The sparse FFN kernel for slabs laid out as `spec` (a SlabSpec; None: no kernel applies):
    Metal on the GPU (SwiGLU only: it fuses silu; other gates take the reference path), the CPU
    kernel otherwise. Chosen once, at load."""
    if spec is None or (self.on_gpu and act is not GateActivation.SILU):
        return None
    if self.on_gpu:
        return MetalSparseFFN(spec)
    return CpuSparseFFN(spec, self.kernel_threads, self.arith)


def sparse_ffn(self, call, x: mx.array, act: GateActivation) -> mx.array:
    """x [.., D] -> the FFN output over call's active bundles (an ffn_source.SparseCall), the gate
    through `act`. On the CPU the kernel's products over the active slots of the slab (a neuron
    cache in MLX memory) are nodes of the graph like any product: no host round trip. The Metal
    kernel fuses SwiGLU; sparse_kernel gives other gates none (the reference path)."""
    shape = x.shape
    if self.on_gpu:  # the slab: the neuron cache where the read put it (unified memory MLX allocated)
        k, T = call.kernel, x.size // shape[-1]
        slab, idx, count = (
            mlx_kernels.framework_array(call.slab),
            mx.array(call.idx.astype(np.int32)),
            mx.array([call.count], mx.int32),
        )
        h = k.gate_up(x.reshape(T, shape[-1]).astype(mx.float32), slab, idx, count)
        if call.mask is not None:
            pad = np.zeros((T, h.shape[1]), np.float32)
            pad[:, : call.mask.shape[1]] = call.mask
            h = h * mx.array(pad)
        return k.down(h, slab, idx, count).astype(self.act_dtype).reshape(shape)
    if call.count == 0:
        return mx.zeros(shape, dtype=self.act_dtype)
    gate, up, down = slab_graphs(self, call)
    x2 = x.reshape(-1, shape[-1])
    ids = mx.array(np.ascontiguousarray(call.idx[: call.count], dtype=np.int32))
    if act is GateActivation.SILU and call.mask is None:  # the layer in one node, identical to the pieces
        return mlx_kernels.gated_ffn(x2, gate, up, down, ids, call.count).reshape(shape)
    h = self.gated(act, gate.sparse(x2, ids, call.count), up.sparse(x2, ids, call.count))
    if call.mask is not None:
        h = h * mx.array(call.mask)
    return down.sparse(h, ids, call.count).reshape(shape)


def slab_graphs(self, call):
    """The graph operations of a slab's gate, up and down (backends.slab_operators: kept per slab)."""
    return slab_operators(self._slabs, call, lambda m: mlx_kernels.GraphMatrix(m, self.kernel_threads, self.arith))
