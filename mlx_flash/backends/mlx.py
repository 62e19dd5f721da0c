"""MLX backend: the op subset the model graphs use, mapped onto mlx.core / mx.fast.

Metal on Apple silicon, CPU elsewhere. Activations are float32 on the CPU device (MLX's CPU
kernels are slow in half precision) and float16 on the GPU. Quantized linears: on the GPU
`mx.quantized_matmul` on the packed arrays and, for GGUF block kinds, our Metal kernel over their
bytes (mlx_flash.kernels.metal_blocks); on the CPU our kernels as MLX primitives
(mlx_flash.kernels.mlx_kernels: products over the stored bytes, embedding rows, attention) inside
the lazy graph, since MLX's CPU quantized_matmul is ~7x slower and its CPU attention runs on a
reference BLAS (python -m mlx_flash.bench matmul); a token's forward is built lazily and evaluated once.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

from ..kernels import mlx_kernels
from ..ffn_source import GateActivation
from ..slot_turns import SlotTurns
from ..models.cache import RowsMask, WindowMask
from ..models.rope import frequencies_key, kernel_inverse_frequencies
from . import (
    covered_bytes,
    cpu_threads,
    expert_operators,
    fused_ffn_weights,
    leaves,
    mlx_scores,
    mlx_sparse,
    mlx_weights,
    owner,
    walk,
    mlx_attention,
)
from .arithmetic import choose_arithmetic
from .mlx_weights import Weight
from .thresholded import Thresholded, thresholded_ffn

NAME = "mlx"
# MLX keeps freed buffers for reuse, capped at this: the memory plan's runtime share
# (memory/process_plan.py, RUNTIME_SLACK) holds the cache at its cap, not whatever a long prefill left.
MLX_CACHE_LIMIT = 32 << 20


class MLXOps:
    """The MLX backend's op set: implements backends.ops.Ops, and LazyOps (its slot turns) since a
    CPU graph is lazy."""

    name = NAME

    def __init__(self, device: str | None = None, threads: int | None = None, arithmetic: str = "exact"):
        if device:
            mx.set_default_device(mx.Device(mx.cpu if device == "cpu" else mx.gpu))
        self.on_gpu = mx.default_device() == mx.gpu
        self.act_dtype = mx.float16 if self.on_gpu else mx.float32
        self.kernel_threads = threads or cpu_threads()
        # GGUF block rows on a GPU still run the CPU primitive (kernel_weight), in float there
        self.arithmetic = choose_arithmetic(arithmetic, not self.on_gpu, "MLX on the GPU")
        self.arith = self.arithmetic.arith
        # Times this backend turned a lazy array into host memory (each one evaluates the graph and
        # waits for it): the host syncs a decode step costs (python -m mlx_flash.bench sparse-kernels --syncs).
        self.host_syncs = 0
        self._rope_freqs: dict = {}  # (dims, base) -> inverse frequencies, for the CPU rope
        self._turns: list[SlotTurns] = []  # streamed slots' turns, settled after each evaluation
        self._slabs: dict = {}  # (address, shape) of a sparse FFN's slab -> (slab, its graph operations)
        mx.set_cache_limit(MLX_CACHE_LIMIT)
        if not self.on_gpu:
            mlx_kernels.extension()  # a missing, stale or mismatched kernel build fails here, at load, naming the fix

    def describe(self) -> str:
        if self.on_gpu:
            return f"mlx {mx.__version__} (gpu)"
        return (
            f"mlx {mx.__version__} (cpu; products, embedding rows and attention as MLX primitives over the "
            f"stored bytes, {self.kernel_threads} kernel threads, {self.arith.name.lower()} arithmetic)"
        )

    @property
    def lazy(self) -> bool:
        """Whether a product runs when the graph is evaluated, not when it is called: streamed slots
        then take turns inside the graph (slot_turns.py)."""
        return not self.on_gpu

    def slot_turns(self, name: str) -> SlotTurns:
        """Turns of a set of streamed slots (slot_turns.SlotTurns over this backend's fences); each
        host round trip settles them (every claim built so far has run)."""
        ext = mlx_kernels.extension()
        turns = SlotTurns(ext.Fence(), ext.Fence(), name)
        self._turns.append(turns)
        return turns

    def gate_weights(self, tree, gate) -> None:
        """Make every product over the weights of `tree` (a layer's) wait for `gate`'s turn."""
        for w in walk(tree, lambda t: isinstance(t, Weight)):
            if w.graph is not None:
                w.graph.gate = gate

    def _settle(self) -> None:
        for turns in self._turns:
            turns.settle()

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """Memory for bytes read from the store, as a writable uint8 numpy view (page-aligned) of memory
        MLX allocated: the CPU primitives take it as inputs where the read put it, and on a Mac, where
        that memory is the GPU's too, so do Metal kernels (mlx_kernels.framework_array)."""
        return mlx_kernels.framework_buffer(nbytes)

    def host_array(self, view: np.ndarray, after=None, gate=None) -> mx.array:
        raw = view.reshape(-1).view(np.uint8)
        if mlx_kernels.buffer_of(raw) is None:  # a copy would take neither side's writes: never silently
            raise ValueError("host_array: the view is not of memory host_buffer allocated")
        a = mlx_kernels.framework_array(raw)
        if gate is not None:
            turns, seq = gate.turns, gate.seq
            a = mlx_kernels.extension().await_fence(a, after, turns.ready, seq, turns.release, seq - 1)
        return (a if view.dtype == np.uint8 else a.view(mx.float32)).reshape(view.shape)

    def held_bytes(self, tree) -> int:
        """Bytes of memory the arrays of a weights tree hold (each buffer counted once)."""
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

    # a linear's stored parts as a Weight, and one over rows laid out elsewhere (backends/mlx_weights.py)
    weight = mlx_weights.weight
    kernel_weight = mlx_weights.kernel_weight
    matmul_only = mlx_weights.matmul_only
    thresholded = mlx_weights.thresholded

    @property
    def in_place_kernel(self) -> bool:
        """Whether kernel_weight() works here: on a CPU, quantized linears run the CPU kernel."""
        return not self.on_gpu

    def inference(self):
        return contextlib.nullcontext()

    def to_numpy(self, x: mx.array) -> np.ndarray:
        self.host_syncs += 1
        out = np.array(x.astype(mx.float32))
        self._settle()
        return out

    # ---- sparse FFN kernels (mlx_flash.kernels.sparse_ffn) ---------------------------------------------
    # the sparse FFN kernels' members for MLX (backends/mlx_sparse.py)
    sparse_kernel = mlx_sparse.sparse_kernel
    sparse_ffn = mlx_sparse.sparse_ffn

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
        self._settle()

    # ---- ops ----------------------------------------------------------------------------------
    def linear(self, x: mx.array, w: Weight) -> mx.array:
        if isinstance(w, Thresholded):  # TEAL sparsity: backends/thresholded.py
            return w.product(self, x)
        if w.metal is not None:
            y = w.metal(x)
        elif w.graph is not None:
            if w.graph.external:  # evaluated as it is built (kernels/mlx_kernels.py)
                self.host_syncs += 1
            y = w.graph(x)
        elif w.quant is not None:
            y = mx.quantized_matmul(
                x, w.w, w.scales, w.biases, transpose=not w.transposed, group_size=w.quant.group_size, bits=w.quant.bits
            )
        else:
            y = x @ (w.w if w.transposed else w.w.T)
        return y + w.bias if w.bias is not None else y

    def embedding(self, w: Weight, ids: mx.array) -> mx.array:
        if w.matrix is not None:  # rows of the stored bytes, in the graph (ids are checked by the engine)
            return w.graph.rows(ids).astype(self.act_dtype)
        if w.quant is None:
            return w.w[ids]
        return mx.dequantize(w.w[ids], w.scales[ids], w.biases[ids], group_size=w.quant.group_size, bits=w.quant.bits)

    def rms_norm(self, x, weight, eps: float):
        if not self.on_gpu:  # MLX's CPU rms_norm is several passes
            return mlx_kernels.rms_norm(x, weight, eps)
        return mx.fast.rms_norm(x, weight, eps)

    def layer_norm(self, x, weight, bias, eps: float):
        return mx.fast.layer_norm(x, weight, bias, eps)

    def rope(self, x, dims: int, traditional: bool, base: float, offset, scale: float = 1.0, freqs=None):
        """offset: the first token's position, one int, or int numpy [B], one per row of a batch.
        freqs: inverse frequencies [dims / 2] (numpy) replacing those of `base` (models/rope.py)."""
        if not self.on_gpu:  # MLX's CPU rope is several passes
            inv = self._inv_freqs(dims, base, freqs)
            pos = (
                mx.full((x.shape[0],), offset, dtype=mx.int32)
                if isinstance(offset, int)
                else mx.array(np.broadcast_to(np.asarray(offset, dtype=np.int32), (x.shape[0],)))
            )
            return mlx_kernels.rope(x, inv, pos, dims, traditional, scale)
        if isinstance(offset, np.ndarray):
            offset = mx.array(offset.astype(np.int32))
        if freqs is not None:  # mx.fast.rope takes each pair's period (1 / inverse frequency)
            return mx.fast.rope(
                x,
                dims,
                traditional=traditional,
                base=None,
                scale=scale,
                offset=offset,
                freqs=mx.array((1.0 / freqs).astype(np.float32)),
            )
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)

    def _inv_freqs(self, dims: int, base: float, freqs) -> mx.array:
        """Each pair's inverse frequency (float32 [dims / 2]): `freqs`, or base^(-2i / dims); kept per
        (dims, base, freqs) so a decode step builds none."""
        key = frequencies_key(dims, base, freqs)
        if key not in self._rope_freqs:
            self._rope_freqs[key] = mx.array(kernel_inverse_frequencies(dims, base, freqs))
        return self._rope_freqs[key]

    def gated(self, act: GateActivation, gate, up):
        """act(gate) * up, a gated FFN's activations (the one place every path takes them, so sparse
        and resident steps agree to the bit): SwiGLU in one pass on the CPU."""
        if act is GateActivation.SILU and not self.on_gpu:
            return mlx_kernels.silu_mul(gate, up)
        return act.apply(self, gate) * up

    def gated_ffn(self, act: GateActivation, gate_up, down, x):
        """down(act(gate) * up) of x as one node where this backend has one for these weights (SwiGLU over
        stored matrices without biases, on the CPU: mlx_kernels.gated_ffn, identical to the pieces),
        else None: the caller composes the pieces. Thresholded weights: mlx_kernels.cm_gated_ffn."""
        if self.on_gpu:
            return None
        if (fused := thresholded_ffn(act, gate_up, down, x, mlx_kernels.cm_gated_ffn)) is not None:
            return fused
        found = fused_ffn_weights(
            act, gate_up, down, lambda w: isinstance(w, Weight) and w.graph is not None and w.bias is None
        )
        if found is None:
            return None
        gate, up, dn = (w.graph if w is not None else None for w in found)
        if any(g is not None and g.external for g in (gate, up, dn)):  # evaluated as built (mlx_kernels.py)
            self.host_syncs += 1
        return mlx_kernels.gated_ffn(x, gate, up, dn)

    @staticmethod
    def route(logits, k: int, renormalize: bool, unit: bool):
        p = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
        ids = mx.argsort(-p, axis=-1)[:, :k]  # a stable sort: ties keep the lower id first
        w = mx.take_along_axis(p, ids, axis=-1)
        if unit:
            w = mx.ones_like(w)
        elif renormalize:
            w = w / w.sum(axis=-1, keepdims=True)
        return ids.astype(mx.int32), w

    def routing_to_host(self, ids, weights):
        # one evaluation and one export: ids ride along as float32 (exact below 2^24 experts)
        both = self.to_numpy(mx.concatenate([ids.astype(mx.float32), weights], axis=-1))
        k = ids.shape[-1]
        return both[:, :k].astype(np.int32), np.ascontiguousarray(both[:, k:])

    def moe_experts(self, act: GateActivation, x, ids, weights, total, experts: dict, n_experts: int):
        """The routed experts in one node (mlx_kernels.moe_experts) on the CPU over stored matrices, else
        None."""
        if self.on_gpu:
            return None
        graph = {
            e: expert_operators(act, fw, lambda w: w.graph if isinstance(w, Weight) else None)
            for e, fw in experts.items()
        }
        if any(o is None for o in graph.values()):
            return None
        if any(m is not None and m.external for o in graph.values() for m in o):  # evaluated as built
            self.host_syncs += 1
        return mlx_kernels.moe_experts(x, ids, weights, total, graph, n_experts, self.kernel_threads)

    def evaluate(self, x) -> None:
        mx.eval(x)
        self.host_syncs += 1

    def write_tokens(self, buffer, x, offset: int):
        """`buffer` [B, H, cap, hd] with x [B, H, T, hd] written at tokens offset.. (a KV cache's
        append): in place on the CPU, where MLX would copy the whole buffer for a slice update."""
        if not self.on_gpu:
            return mlx_kernels.write_tokens(buffer, x, offset)
        buffer[:, :, offset : offset + x.shape[2], :] = x
        return buffer

    def sdpa(self, q, k, v, scale: float, mask=None):
        """q [B,Hq,T,hd], k/v [B,Hkv,S,hd]. mask: None, "causal" (the last query aligned with the last
        key), a RowsMask or a WindowMask (models/cache.py) or a boolean mask from `mask` [B, 1, T, S]
        (True: attend). On the CPU the first four run our attention primitive (MLX's CPU attention
        multiplies on a reference BLAS); a boolean mask runs MLX's."""
        if not self.on_gpu and (mask is None or isinstance(mask, (str, RowsMask, WindowMask))):
            if isinstance(mask, RowsMask):  # each row of a padded batch as it computes alone
                lens, pos = mx.array(mask.kv_len), mx.array(mask.q_pos)
                return mlx_kernels.attention(q, k, v, scale, self.kernel_threads, lens, pos)
            window = mask.window if isinstance(mask, WindowMask) else 0
            return mlx_kernels.attention(q, k, v, scale, self.kernel_threads, window=window)
        if isinstance(mask, (RowsMask, WindowMask)):
            mask = self.mask(mask.keep(q.shape[-2], k.shape[-2]))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    # attention where the KV lies: compressed blocks and a chunk pool (backends/mlx_attention.py)
    sdpa_coded = mlx_attention.sdpa_coded
    sdpa_slots = mlx_attention.sdpa_slots
    sdpa_mixed = mlx_attention.sdpa_mixed

    def mask(self, keep: np.ndarray):
        """A boolean numpy mask as sdpa takes it."""
        return mx.array(keep)

    def positions(self, offset, T: int):
        """Token positions [1 or B, T] from `offset` (an int, or int numpy [B] per row)."""
        if isinstance(offset, np.ndarray):
            return mx.array((offset[:, None] + np.arange(T)).astype(np.int32))
        return mx.arange(offset, offset + T)[None]

    # attention scores for KV compression and top-k sparse attention (backends/mlx_scores.py)
    attention_columns = mlx_scores.attention_columns
    top_k_mask = mlx_scores.top_k_mask

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
