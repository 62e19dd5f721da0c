"""MLX backend: the op subset the model graphs use, mapped onto mlx.core / mx.fast.

Metal on Apple silicon, CPU elsewhere. Activations are float32 on the CPU device (MLX's CPU
kernels are slow in half precision) and float16 on the GPU. Quantized linears: on the GPU
`mx.quantized_matmul` on the packed arrays; on the CPU the stored bytes stay numpy arrays that the
fused CPU kernel (mlx_flash.kernels.qmatmul) computes on, since MLX's CPU quantized_matmul is ~7x
slower (tools/bench_kernel.py); only activations cross between MLX and the kernel.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..kernels.qmatmul import KERNEL_BITS, StoredMatrix, dequantize_rows, library
from ..ffn_source import GateActivation
from ..kernels.sparse_ffn import CpuSparseFFN
from ..quant_spec import QuantSpec
from ..memory.process_plan import MLX_CACHE_LIMIT

from . import block_matrix, cpu_threads

NAME = "mlx"


@dataclass
class Weight:
    """A linear layer's weight. `transposed` means stored [in, out] (bundle rows of down columns)."""

    w: mx.array | None
    scales: mx.array | None
    biases: mx.array | None
    bias: mx.array | None
    quant: QuantSpec | None
    transposed: bool
    # CPU: the stored (words, scales, biases, bfloat16 scales?) as numpy arrays, and no mx copies, and
    # the kernel's view of them (checked once at load)
    stored: tuple | None = None
    matrix: StoredMatrix | None = None


class MLXOps:
    name = NAME

    def __init__(self, device: str | None = None, threads: int | None = None):
        if device:
            mx.set_default_device(mx.Device(mx.cpu if device == "cpu" else mx.gpu))
        self.on_gpu = mx.default_device() == mx.gpu
        self.act_dtype = mx.float16 if self.on_gpu else mx.float32
        self.kernel_threads = threads or cpu_threads()
        # Times this backend turned a lazy array into host memory (each one evaluates the graph and
        # waits for it): the host syncs a decode step costs (tools/bench_kernels.py --syncs).
        self.host_syncs = 0
        # MLX keeps freed buffers for reuse; the memory plan counts this cache at its cap, not at
        # whatever a long prefill left in it.
        mx.set_cache_limit(MLX_CACHE_LIMIT)
        if not self.on_gpu:
            library()  # a missing or stale kernel library fails here, at load, naming the fix

    def describe(self) -> str:
        if self.on_gpu:
            return f"mlx {mx.__version__} (gpu)"
        return f"mlx {mx.__version__} (cpu; quantized linears on the stored bytes, {self.kernel_threads} kernel threads)"

    def held_bytes(self, tree) -> int:
        """Bytes of memory the arrays of a weights tree hold (each buffer counted once)."""
        from . import covered_bytes, leaves, owner

        arrays, ranges = {}, []
        for a in leaves(tree):
            if isinstance(a, mx.array):
                arrays[id(a)] = a.nbytes
            elif isinstance(a, np.ndarray):
                base = owner(a)
                ranges.append((base.ctypes.data, base.nbytes))
        return sum(arrays.values()) + covered_bytes(ranges)

    # ---- conversion at the compute edge ----------------------------------------------------------
    def array(self, a: np.ndarray, dtype: str | None = None, cast: bool = True) -> mx.array:
        """numpy -> mx (copies). bfloat16 arrives as uint16 words. Floats become the activation dtype
        unless cast=False."""
        if dtype == "bfloat16":
            out = mx.array(a.view(np.uint16)).view(mx.bfloat16)
        else:
            out = mx.array(a)
        if cast and mx.issubdtype(out.dtype, mx.floating):
            out = out.astype(self.act_dtype)
        return out

    @staticmethod
    def matmul_only(w: Weight) -> Weight:
        """A weight only multiplied: MLX keeps nothing extra for embedding lookups."""
        return w

    def weight(self, parts: dict, quant: QuantSpec | None, transposed: bool = False, dtypes: dict | None = None) -> Weight:
        dtypes = dtypes or {}
        if quant is None:
            return Weight(self.array(parts["weight"], dtypes.get("weight")), None, None,
                          self._opt(parts, "bias", dtypes), None, transposed)
        if quant.is_block:  # GGUF block rows: the CPU block kernel (on a GPU too: no Metal kernel yet)
            matrix = block_matrix(parts["weight"], quant, transposed)
            return Weight(None, None, None, self._opt(parts, "bias", dtypes), quant, False, (matrix.raw,), matrix)
        if not self.on_gpu and quant.bits in KERNEL_BITS:
            stored = (np.ascontiguousarray(parts["weight"]).view(np.uint32), np.ascontiguousarray(parts["scales"]),
                      np.ascontiguousarray(parts["biases"]), dtypes.get("scales") == "bfloat16")
            matrix = StoredMatrix(*stored[:3], quant.bits, quant.group_size, not transposed, stored[3])
            return Weight(None, None, None, self._opt(parts, "bias", dtypes), quant, transposed, stored, matrix)
        # Scales/biases in the activation dtype: quantized_matmul wants one float type throughout.
        return Weight(
            mx.array(parts["weight"]), self.array(parts["scales"], dtypes.get("scales")),
            self.array(parts["biases"], dtypes.get("biases")), self._opt(parts, "bias", dtypes), quant, transposed,
        )

    @property
    def in_place_kernel(self) -> bool:
        """Whether kernel_weight() works here: on a CPU, quantized linears run the CPU kernel."""
        return not self.on_gpu

    def kernel_weight(self, matrix: StoredMatrix, quant: QuantSpec) -> Weight:
        """A weight the CPU kernel multiplies where its bytes lie (a StoredMatrix over laid-out rows,
        e.g. inside a layer's bundles); not usable as an embedding."""
        return Weight(None, None, None, None, quant, False, (), matrix)  # () : no arrays of its own to count

    def _opt(self, parts, key, dtypes):
        return self.array(parts[key], dtypes.get(key)) if parts.get(key) is not None else None

    def inference(self):
        return contextlib.nullcontext()

    def to_numpy(self, x: mx.array) -> np.ndarray:
        self.host_syncs += 1
        return np.array(x.astype(mx.float32))

    # ---- sparse FFN kernels (mlx_flash.kernels.sparse_ffn) ---------------------------------------------
    def sparse_kernel(self, spec, act: GateActivation):
        """The sparse FFN kernel for slabs laid out as `spec` (a SlabSpec; None: no kernel applies):
        Metal on the GPU (SwiGLU only: it fuses silu; other gates take the reference path), the CPU
        kernel otherwise. Chosen once, at load."""
        if spec is None or (self.on_gpu and act is not GateActivation.SILU):
            return None
        if self.on_gpu:
            from ..kernels.metal_sparse import MetalSparseFFN

            return MetalSparseFFN(spec)
        return CpuSparseFFN(spec, self.kernel_threads)

    def sparse_ffn(self, call, x: mx.array, act: GateActivation) -> mx.array:
        """x [.., D] -> the FFN output over call's active bundles (an ffn_source.SparseCall), the gate
        through `act`. On the CPU two host round trips per layer: x out and the products back (MLX's own
        activation, so a step equals the resident model's to the bit), the activations out and y back.
        The Metal kernel fuses SwiGLU; sparse_kernel gives other gates none (the reference path)."""
        shape = x.shape
        if self.on_gpu:  # the slab crosses once per call (mx.array copies host memory)
            k, T = call.kernel, x.size // shape[-1]
            slab, idx, count = mx.array(call.slab), mx.array(call.idx.astype(np.int32)), mx.array([call.count], mx.int32)
            h = k.gate_up(x.reshape(T, shape[-1]).astype(mx.float32), slab, idx, count)
            if call.mask is not None:
                pad = np.zeros((T, h.shape[1]), np.float32)
                pad[:, :call.mask.shape[1]] = call.mask
                h = h * mx.array(pad)
            return k.down(h, slab, idx, count).astype(self.act_dtype).reshape(shape)
        self.host_syncs += 2
        x2 = np.ascontiguousarray(np.asarray(x.reshape(-1, shape[-1]), dtype=np.float32))
        g, u = call.kernel.products(x2, call.slab, call.idx, call.count)
        h = act.apply(self, mx.array(g)) * mx.array(u)
        if call.mask is not None:
            h = h * mx.array(call.mask)
        h = np.ascontiguousarray(np.asarray(h, dtype=np.float32))
        return mx.array(call.kernel.down(h, call.slab, call.idx, call.count)).reshape(shape)

    def tokens(self, ids) -> mx.array:
        """Token ids [T] (one sequence) or [B, T] -> an int array [1 or B, T]."""
        a = np.asarray(ids, dtype=np.int32)
        return mx.array(a.reshape(1, -1) if a.ndim < 2 else a)

    def index(self, ids) -> mx.array:
        """A 1-D integer array to index with (x[:, idx] gathers, x[:, idx] = y scatters)."""
        return mx.array(np.asarray(ids, dtype=np.int32).reshape(-1))

    def materialize(self, *arrays) -> None:
        """Compute lazy arrays now (preallocated buffers then hold their memory)."""
        mx.eval(*arrays)

    # ---- ops ----------------------------------------------------------------------------------
    def linear(self, x: mx.array, w: Weight) -> mx.array:
        if w.stored is not None:
            self.host_syncs += 1
            x2 = np.ascontiguousarray(np.asarray(x.reshape(-1, x.shape[-1]), dtype=np.float32))  # a view when it can be
            y = w.matrix(x2, self.kernel_threads)
            y = mx.array(y).reshape(*x.shape[:-1], y.shape[-1])
        elif w.quant is not None:
            y = mx.quantized_matmul(x, w.w, w.scales, w.biases, transpose=not w.transposed,
                                    group_size=w.quant.group_size, bits=w.quant.bits)
        else:
            y = x @ (w.w if w.transposed else w.w.T)
        return y + w.bias if w.bias is not None else y

    def embedding(self, w: Weight, ids: mx.array) -> mx.array:
        if w.quant is not None and w.quant.is_block:
            self.host_syncs += 1
            return mx.array(w.matrix.rows(np.array(ids))).astype(self.act_dtype)
        if w.stored is not None:
            self.host_syncs += 1
            words, scales, biases, bf16 = w.stored
            i = np.array(ids)
            return mx.array(dequantize_rows(words[i], scales[i], biases[i], w.quant.bits, w.quant.group_size, bf16))
        if w.quant is None:
            return w.w[ids]
        return mx.dequantize(w.w[ids], w.scales[ids], w.biases[ids], group_size=w.quant.group_size, bits=w.quant.bits)

    def rms_norm(self, x, weight, eps: float):
        return mx.fast.rms_norm(x, weight, eps)

    def layer_norm(self, x, weight, bias, eps: float):
        return mx.fast.layer_norm(x, weight, bias, eps)

    def rope(self, x, dims: int, traditional: bool, base: float, offset, scale: float = 1.0, freqs=None):
        """offset: the first token's position, one int, or int numpy [B], one per row of a batch.
        freqs: inverse frequencies [dims / 2] (numpy) replacing those of `base` (models/rope.py)."""
        if isinstance(offset, np.ndarray):
            offset = mx.array(offset.astype(np.int32))
        if freqs is not None:  # mx.fast.rope takes each pair's period (1 / inverse frequency)
            return mx.fast.rope(x, dims, traditional=traditional, base=None, scale=scale, offset=offset,
                                freqs=mx.array((1.0 / freqs).astype(np.float32)))
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)

    def sdpa(self, q, k, v, scale: float, mask=None):
        """q [B,Hq,T,hd], k/v [B,Hkv,S,hd]. mask: None, "causal" (the last query aligned with the last
        key) or a boolean mask from `mask` [B, 1, T, S] (True: attend)."""
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def mask(self, keep: np.ndarray):
        """A boolean numpy mask as sdpa takes it."""
        return mx.array(keep)

    def positions(self, offset, T: int):
        """Token positions [1 or B, T] from `offset` (an int, or int numpy [B] per row)."""
        if isinstance(offset, np.ndarray):
            return mx.array((offset[:, None] + np.arange(T)).astype(np.int32))
        return mx.arange(offset, offset + T)[None]

    def attention_columns(self, q, k, scale: float):
        """Attention mass each key receives: softmax(q k^T * scale) with the causal mask (aligned as
        sdpa's), summed over heads and queries. q [1, Hq, T, hd], k [1, Hkv, S, hd] -> [S] float32
        (KV compression's information density; reference: service/compression.py)."""
        _, Hq, T, hd = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        qg = q.astype(mx.float32).reshape(Hkv, (Hq // Hkv) * T, hd)
        s = (qg @ k[0].astype(mx.float32).transpose(0, 2, 1)) * scale
        if T > 1:
            t = mx.arange(T)[:, None] + (S - T)
            mask = mx.arange(S)[None, :] <= t  # [T, S]
            s = mx.where(mx.tile(mask, (Hq // Hkv, 1))[None], s, -mx.inf)
        return mx.softmax(s, axis=-1).sum(axis=(0, 1))

    def top_k_mask(self, q, k, scale: float, mask, keep: float):
        """Each query's top `keep` share of the keys it may see, as a bool mask [B, Hq, T, S] for sdpa
        (top-k sparse attention; reference: offload/sparse_attention.top_k_mask_reference)."""
        B, Hq, T, hd = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        qg = q.astype(mx.float32).reshape(B, Hkv, (Hq // Hkv) * T, hd)
        s = ((qg @ k.astype(mx.float32).transpose(0, 1, 3, 2)) * scale).reshape(B, Hq, T, S)
        if mask is None:
            vis = mx.ones((1, 1, T, S), dtype=mx.bool_)
        elif isinstance(mask, str):
            vis = (mx.arange(S)[None, :] <= mx.arange(T)[:, None] + (S - T))[None, None]
        else:
            vis = mask
        s = mx.where(vis, s, -mx.inf)
        n = mx.maximum(mx.ceil(vis.sum(axis=-1, keepdims=True).astype(mx.float32) * keep), 1).astype(mx.int32)
        thr = mx.take_along_axis(mx.sort(s, axis=-1), mx.broadcast_to(S - n, (B, Hq, T, 1)), axis=-1)
        return (s >= thr) & vis

    silu = staticmethod(lambda x: x * mx.sigmoid(x))
    relu = staticmethod(lambda x: mx.maximum(x, 0))

    def gelu(self, x, approximate: bool = False):
        if approximate:
            return 0.5 * x * (1 + mx.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
        return x * (1 + mx.erf(x / 1.4142135623730951)) / 2

    def reshape(self, x, shape):
        return x.reshape(shape)

    def transpose(self, x, axes):
        return x.transpose(axes)

    def zeros(self, shape, like):
        return mx.zeros(shape, dtype=like.dtype)

    def split(self, x, sizes):
        """Split the last axis into consecutive pieces of the given sizes."""
        idx, acc = [], 0
        for n in sizes[:-1]:
            acc += n
            idx.append(acc)
        return mx.split(x, idx, axis=-1)

    def concatenate(self, xs, axis: int):
        return mx.concatenate(xs, axis=axis)

    def take(self, x, idx):
        """Entries idx (an int array) of the last axis."""
        return mx.take(x, idx, axis=-1)

    def take_tokens(self, x, idx):
        """Entries idx (an int array) of axis 1: tokens of a KV array [H, N, hd] (as x[:, idx] reads
        them; a torch index_select is ~6x faster than the indexing for the server's gathers)."""
        return mx.take(x, idx, axis=1)

    def take_rows(self, x, idx):
        """Rows idx of x [N, ...]."""
        return mx.take(x, idx, axis=0)

    def add_rows(self, x, idx, y):
        """x with y added to its rows idx (distinct), as a new array."""
        return x.at[idx].add(y)

    sigmoid = staticmethod(lambda x: mx.sigmoid(x))

    def last_token(self, x):
        return x[:, -1:, :]
