"""The sparse FFN of the torch backend, as methods of TorchOps: which member of the sparse kernels
runs (CUDA on an NVIDIA GPU, the CPU kernel's operators elsewhere) and a decode step over a slab."""

from __future__ import annotations

import numpy as np

from ..ffn_source import GateActivation
from ..kernels import torch_ops
from ..kernels.cuda_sparse import CudaSparseFFN
from ..kernels.sparse_ffn import CpuSparseFFN
from . import slab_operators

try:
    import torch
except ImportError:  # the torch backend says what to install (TorchOps refuses to start without it)
    torch = None


def sparse_kernel(self, spec, act: GateActivation):
    """The sparse FFN kernel for slabs laid out as `spec` (a SlabSpec; None: no kernel applies):
    CUDA on an NVIDIA GPU (built at first use; SwiGLU only: it fuses silu, other gates take the
    reference path), the CPU kernel otherwise. Chosen once, at load."""
    if spec is None or (self.device.type == "cuda" and act is not GateActivation.SILU):
        return None
    if self.device.type == "cuda":
        return CudaSparseFFN(spec)
    return CpuSparseFFN(spec, self.kernel_threads, self.arith)


def sparse_ffn(self, call, x, act: GateActivation):
    """x [.., D] -> the FFN output over call's active bundles (an ffn_source.SparseCall), the gate
    through `act`. The CUDA kernel fuses SwiGLU; sparse_kernel gives other gates none (the
    reference path)."""
    shape = x.shape
    k = call.kernel
    if self.device.type == "cuda":  # the slab crosses once per call
        dev = self.device
        slab = torch.from_numpy(call.slab).to(dev, non_blocking=True)
        idx = torch.from_numpy(call.idx.astype(np.int32)).to(dev)
        count = torch.tensor([call.count], dtype=torch.int32, device=dev)
        h = k.gate_up(x.reshape(-1, shape[-1]).float().contiguous(), slab, idx, count)
        if call.mask is not None:
            h[:, : call.mask.shape[1]] *= torch.from_numpy(call.mask).to(dev)
        return k.down(h, slab, idx, count).to(self.act_dtype).reshape(shape)
    if call.count == 0:
        return torch.zeros(shape, dtype=self.act_dtype)
    gate, up, down = self._slab_ops(call)  # the operators over the slab where it lies
    x2 = x.reshape(-1, shape[-1]).to(torch.float32)
    ids = torch.from_numpy(np.ascontiguousarray(call.idx[: call.count], dtype=np.int32))
    if act is GateActivation.SILU and call.mask is None:  # the layer in one call, identical to the pieces
        return torch_ops.TorchMatrix.gated_ffn(x2, gate, up, down, ids, call.count).to(self.act_dtype).reshape(shape)
    h = self.gated(act, gate.sparse(x2, ids, call.count), up.sparse(x2, ids, call.count))
    if call.mask is not None:
        h *= torch.from_numpy(call.mask)
    return down.sparse(h, ids, call.count).to(self.act_dtype).reshape(shape)


def slab_ops(self, call):
    """The operators of a slab's gate, up and down (backends.slab_operators: kept per slab)."""
    return slab_operators(self._slabs, call, lambda m: torch_ops.TorchMatrix(m, self.kernel_threads, self.arith))
