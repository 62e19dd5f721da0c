"""torch backend: the same op names and semantics as backends/mlx.py, implemented with torch.

CPU here, CUDA when present. Activations and the residual stream are float32. Two linear modes:
  dtype="float32" (default, exact): quantized weights stay as stored (packed codes, scales,
      biases) and every matmul runs on them, float32 activations and accumulation, no dequantized
      copy. On the CPU through the fused CPU kernel (mlx_flash.kernels.qmatmul), on `threads`
      threads while torch's own ops run on one (two thread pools spinning on the same cores slow
      both down); on CUDA the bytes are moved once to the GPU and multiplied there by the CUDA
      kernel (kernels/cuda/qmatmul.cu, mlx_flash.kernels.cuda_ops; widths or groups it does not
      read are dequantized once into float32). Results match the MLX backend to float32 rounding.
  dtype="bfloat16" (fast, approximate): on the CPU, 4-bit linears run on torch's weight-only int4
      kernel (bfloat16 inputs, scales and outputs), 8-bit ones as two exact 4-bit halves on the same
      kernel, other weights stay dense float32; on CUDA, quantized weights are dequantized once into
      float16 for torch's half-precision matmuls. Its perplexity cost is measured in docs/earlier-results/kernels.md.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..host_memory import anonymous_buffer
from ..kernels import cuda_ops, torch_ops
from ..kernels.kv_codes import pairs_ints
from ..kernels.qmatmul import library
from . import slot_attention
from .coded_blocks import block_layouts
from ..ffn_source import GateActivation

from ..models.cache import RowsMask, WindowMask
from ..models.rope import frequencies_key, kernel_inverse_frequencies
from . import covered_bytes, cpu_threads, expert_operators, fused_ffn_weights, leaves, owner
from . import torch_scores, torch_sparse, torch_weights
from .arithmetic import choose_arithmetic
from .torch_quant import dequantize
from .torch_rope import RopeTables
from .thresholded import Thresholded, thresholded_ffn
from .torch_weights import Weight

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the backend module stays importable so the error can say what to install
    torch = None

NAME = "torch"


DTYPES = ("float32", "bfloat16")


class TorchOps:
    """The torch backend's op set: implements backends.ops.Ops (eager: lazy is False, so not LazyOps)."""

    name = NAME

    def __init__(
        self, device: str | None = None, threads: int | None = None, dtype: str = "float32", arithmetic: str = "exact"
    ):
        if torch is None:
            raise ConfigError("backend 'torch' needs PyTorch: pip install 'mlx-flash-engine[torch]' (torch==2.13.0)")
        if dtype not in DTYPES:
            raise ConfigError(f"torch dtype {dtype!r} is unknown (choose one of: {', '.join(DTYPES)})")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if threads:
            torch.set_num_threads(threads)
        self.act_dtype = torch.float32
        self.dtype = dtype
        # Dense weights: float32 on CPU in both modes (torch's CPU bfloat16 GEMV is no faster here:
        # measured 162 vs ~100 us for a 1536x576 product); float16 on CUDA in the fast mode.
        self.mm_dtype = torch.float16 if (dtype == "bfloat16" and self.device.type == "cuda") else torch.float32
        self.int4_kernel = dtype == "bfloat16" and self.device.type == "cpu"
        self.stored_kernel = dtype == "float32" and self.device.type == "cpu"
        self.cuda_kernel = dtype == "float32" and self.device.type == "cuda"  # the stored product on the GPU
        self.kernel_threads = threads or cpu_threads()
        where = f"torch on {self.device.type}" + (" in bfloat16" if dtype == "bfloat16" else "")
        self.arithmetic = choose_arithmetic(arithmetic, self.stored_kernel, where)
        self.arith = self.arithmetic.arith
        if self.stored_kernel or self.cuda_kernel:
            library()  # a missing or stale kernel library fails here, at load, naming the fix
            # built on first use (the CUDA operator after the CPU ones); a failed build is named here, at load
            (cuda_ops if self.cuda_kernel else torch_ops).ops()
        if self.stored_kernel:
            torch.set_num_threads(1)
        self._rope_tables = RopeTables()
        self._inv_freqs: dict = {}  # (dims, base) -> inverse frequencies, for the CPU rope
        self._slabs: dict = {}  # (address, shape) of a sparse FFN's slab -> (slab, its operators)

    def describe(self) -> str:
        if self.stored_kernel:
            return (
                f"torch {torch.__version__} (cpu, float32; quantized linears on the stored bytes, "
                f"{self.kernel_threads} kernel threads, {self.arith.name.lower()} arithmetic; torch ops on 1 thread)"
            )
        if self.cuda_kernel:
            return f"torch {torch.__version__} ({self.device}, float32; quantized linears on the stored bytes)"
        return f"torch {torch.__version__} ({self.device}, {torch.get_num_threads()} threads, {self.dtype})"

    def held_bytes(self, tree) -> int:
        """Bytes of memory the tensors of a weights tree hold as this backend keeps them (a float32
        copy of 4-bit weights holds 8x their stored size); shared storage counted once."""
        ranges = []  # a torch tensor and a numpy view of one buffer count once
        for t in leaves(tree):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                ranges.append((s.data_ptr(), s.nbytes()))
            elif isinstance(t, np.ndarray):
                base = owner(t)
                ranges.append((base.ctypes.data, base.nbytes))
        return covered_bytes(ranges)

    # ---- conversion at the compute edge ----------------------------------------------------------
    def array(self, a: np.ndarray, dtype: str | None = None, cast: bool = True):
        if dtype == "bfloat16":
            t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
        t = t.to(self.device)
        if cast and t.is_floating_point():
            t = t.to(self.act_dtype)
        return t

    # ---- weights (backends/torch_weights.py: the Weight record and how one is built) ------------------
    weight = torch_weights.weight
    _stored = torch_weights.stored
    kernel_weight = torch_weights.kernel_weight
    matmul_only = torch_weights.matmul_only
    thresholded = torch_weights.thresholded

    @property
    def in_place_kernel(self) -> bool:
        """Whether kernel_weight() works here: the CPU kernel multiplies float32 activations."""
        return self.stored_kernel

    def to_numpy(self, x) -> np.ndarray:
        return x.detach().to(torch.float32).cpu().numpy()

    # ---- sparse FFN kernels (mlx_flash.kernels.sparse_ffn) ---------------------------------------------
    # the sparse FFN kernels' members for torch (backends/torch_sparse.py)
    sparse_kernel = torch_sparse.sparse_kernel
    sparse_ffn = torch_sparse.sparse_ffn
    _slab_ops = torch_sparse.slab_ops

    def tokens(self, ids):
        """Token ids [T] (one sequence) or [B, T] -> an int array [1 or B, T]."""
        a = np.asarray(ids, dtype=np.int64)
        return torch.as_tensor(a.reshape(1, -1) if a.ndim < 2 else a, device=self.device)

    def index(self, ids):
        """A 1-D integer array to index with (x[:, idx] gathers, x[:, idx] = y scatters)."""
        return torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1), device=self.device)

    def materialize(self, *arrays) -> None:
        """Compute lazy arrays now: torch is eager, nothing to do."""

    lazy = False  # eager: a product has run when its call returns, so streamed slots take turns in Python

    def gated(self, act: GateActivation, gate, up):
        """act(gate) * up, a gated FFN's activations (every path takes them here, so sparse and resident
        steps agree to the bit): SwiGLU in one pass with the CPU kernel."""
        if act is GateActivation.SILU and self.stored_kernel:
            return torch_ops.ops().silu_mul(gate, up)
        return act.apply(self, gate) * up

    def gated_ffn(self, act: GateActivation, gate_up, down, x):
        """down(act(gate) * up) of x in one operator call where this backend has one for these weights
        (SwiGLU over stored matrices without biases, with the CPU kernel; identical to the pieces),
        else None: the caller composes the pieces. Thresholded weights: torch_ops.cm_gated_ffn."""
        if (fused := thresholded_ffn(act, gate_up, down, x, torch_ops.cm_gated_ffn)) is not None:
            return fused
        found = self.stored_kernel and fused_ffn_weights(
            act, gate_up, down, lambda w: isinstance(w, Weight) and w.kind == "stored" and w.bias is None
        )
        if not found:
            return None
        gate, up, dn = found
        return torch_ops.TorchMatrix.gated_ffn(x, gate.op, up.op if up is not None else None, dn.op)

    @staticmethod
    def route(logits, k: int, renormalize: bool, unit: bool):
        p = torch.softmax(logits.to(torch.float32), dim=-1)
        ids = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: the lower id first
        w = torch.gather(p, -1, ids)
        if unit:
            w = torch.ones_like(w)
        elif renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return ids.to(torch.int32), w

    @staticmethod
    def routing_to_host(ids, weights):
        return ids.cpu().numpy(), weights.cpu().numpy()

    def moe_experts(self, act: GateActivation, x, ids, weights, total, experts: dict, n_experts: int):
        """The routed experts in one operator call (torch_ops.moe_experts) over stored matrices: the CPU
        kernel's, or on CUDA the stored product's (cuda/ops_cuda.cpp); else None."""
        if self.stored_kernel:
            kind = torch_ops.TorchMatrix
        elif self.cuda_kernel:
            kind = cuda_ops.CudaMatrix
        else:
            return None
        operators = {
            e: expert_operators(act, fw, lambda w: w.op if isinstance(w, Weight) and isinstance(w.op, kind) else None)
            for e, fw in experts.items()
        }
        if any(o is None for o in operators.values()):
            return None
        return torch_ops.moe_experts(x, ids, weights, total, operators, n_experts, self.kernel_threads)

    @staticmethod
    def evaluate(x) -> None:
        """Eager: x is computed already."""

    @staticmethod
    def write_tokens(buffer, x, offset: int):
        """`buffer` [B, H, cap, hd] with x [B, H, T, hd] written at tokens offset.., in place."""
        buffer[:, :, offset : offset + x.shape[2], :] = x
        return buffer

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """Memory for bytes read from the store, as a writable uint8 numpy view (page-aligned, so
        direct reads land in place): with the CPU kernel memory torch allocated, which its operators
        take where the read put it; else numpy's (torch.from_numpy shares it)."""
        if self.stored_kernel:
            return torch_ops.framework_buffer(nbytes)
        return anonymous_buffer(nbytes)

    def host_array(self, view: np.ndarray, after=None, gate=None):
        """(eager: a gated read was waited for before the call)"""
        return torch.from_numpy(view)

    # ---- ops ----------------------------------------------------------------------------------
    def linear(self, x, w: Weight):
        if isinstance(w, Thresholded):  # TEAL sparsity: backends/thresholded.py
            return w.product(self, x)
        shape = x.shape
        if w.kind == "stored":  # float32 in and out: the kernel's operator on the stored bytes
            y = w.op(x)
            return y + w.bias if w.bias is not None else y
        x2 = x.reshape(-1, shape[-1])
        if w.kind == "dense":
            y = x2.to(w.w.dtype) @ w.w.t()
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), w.w, w.group_size, w.scale_zeros)
            if w.kind == "int4x2":
                y = y[:, : w.out_features] + y[:, w.out_features :]
        y = y.to(self.act_dtype).reshape(*shape[:-1], w.out_features)
        return y + w.bias if w.bias is not None else y

    def embedding(self, w: Weight, ids):
        if w.kind == "dense" and w.w.dtype == self.act_dtype:  # exact float32 table
            return F.embedding(ids, w.w)
        if w.q is None:
            return F.embedding(ids, w.w).to(self.act_dtype)
        if w.op is not None and self.stored_kernel:  # rows of the stored bytes (ids are checked by the engine)
            return w.op.rows(ids).to(self.act_dtype)
        packed, scales, biases = w.q
        return dequantize(packed[ids], scales[ids], biases[ids], w.quant, self.act_dtype)

    def rms_norm(self, x, weight, eps: float):
        if self.stored_kernel:
            return torch_ops.ops().rms_norm(x, weight, eps)
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)

    def layer_norm(self, x, weight, bias, eps: float):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def rope(self, x, dims: int, traditional: bool, base: float, offset, scale: float = 1.0, freqs=None):
        """Same semantics as mx.fast.rope: rotate the first `dims` features of x [B, H, T, hd] from
        position `offset` (an int, or int numpy [B]: one per row of a batch); freqs: inverse
        frequencies [dims / 2] (numpy) replacing those of `base` (models/rope.py)."""
        if self.stored_kernel:  # one pass of the CPU kernel (kernels/cpu/pointwise.cpp)
            key = frequencies_key(dims, base, freqs)  # kept per key: a decode step converts nothing
            if key not in self._inv_freqs:
                self._inv_freqs[key] = torch.from_numpy(kernel_inverse_frequencies(dims, base, freqs))
            inv = self._inv_freqs[key]
            pos = (
                torch.full((x.shape[0],), offset, dtype=torch.int32)
                if isinstance(offset, int)
                else torch.from_numpy(np.broadcast_to(np.asarray(offset, dtype=np.int32), (x.shape[0],)).copy())
            )
            return torch_ops.ops().rope(x, inv, pos, dims, traditional, scale)
        return self._rope_tables.rope(x, dims, traditional, base, offset, scale, freqs)

    def inference(self):
        """Context for model calls: no autograd bookkeeping."""
        return torch.inference_mode()

    def sdpa(self, q, k, v, scale: float, mask=None):
        """mask: None, "causal", a RowsMask or a WindowMask (models/cache.py) or a boolean mask from `mask`
        [B, 1, T, S] (True: attend); the CPU kernel (kernels/cpu/attention.cpp) runs the first four."""
        if self.stored_kernel and isinstance(mask, WindowMask):
            return torch_ops.ops().attention(q, k, v, scale, self.kernel_threads, window=mask.window)
        if self.stored_kernel and (mask is None or isinstance(mask, (str, RowsMask))):
            rows = (torch.from_numpy(mask.kv_len), torch.from_numpy(mask.q_pos)) if isinstance(mask, RowsMask) else ()
            return torch_ops.ops().attention(q, k, v, scale, self.kernel_threads, *rows)
        T, S = q.shape[-2], k.shape[-2]
        mask = self.mask(mask.keep(T, S)) if isinstance(mask, (RowsMask, WindowMask)) else mask
        if isinstance(mask, str):
            # Lower-right alignment (as mx.fast): query t sees keys up to S - T + t.
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T) if T > 1 else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def sdpa_coded(self, q, k, v, scale: float, codes, fmt, coded: int):
        k_layout, v_layout, table = block_layouts(fmt, codes.shape[0])
        S, T = coded + k.shape[2], q.shape[2]
        return torch_ops.ops().attention_coded(
            q, k, v, scale, self.kernel_threads, codes, k_layout.ints(), codes, v_layout.ints(),
            torch.tensor([[coded], [coded]], dtype=torch.int32), torch.tensor([S], dtype=torch.int32),
            torch.tensor([S - T], dtype=torch.int32), torch.tensor(table),  # a copy: the cached table is read-only
        )  # fmt: skip

    def sdpa_slots(self, q, k, v, scale: float, block_tokens: int, table, kv_len, q_pos):
        if not self.stored_kernel:
            return slot_attention.gathered_sdpa(self, q, k, v, scale, block_tokens, table, kv_len, q_pos)
        shape, axes = slot_attention.block_shape(k.shape, block_tokens)
        return torch_ops.ops().attention(
            q, k.view(shape).permute(axes), v.view(shape).permute(axes), scale, self.kernel_threads,
            torch.from_numpy(np.ascontiguousarray(kv_len, np.int32)),
            torch.from_numpy(np.ascontiguousarray(q_pos, np.int32)),
            torch.from_numpy(np.ascontiguousarray(table, np.int32)),
        )  # fmt: skip

    def sdpa_mixed(self, q, k, v, scale: float, block_tokens: int, table, classes, codes, layouts, kv_len, q_pos):
        if not self.stored_kernel:
            raise ConfigError(
                "kv_compression holds chunks the CPU attention kernel reads (float32 on the CPU): turn it off here"
            )
        shape, axes = slot_attention.block_shape(k.shape, block_tokens)
        i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.int32))  # noqa: E731
        return torch_ops.ops().attention_mixed(
            q, k.view(shape).permute(axes), v.view(shape).permute(axes), scale, self.kernel_threads, codes,
            pairs_ints(tuple(layouts)),
            i32(kv_len), i32(q_pos), i32(table), i32(classes),
        )  # fmt: skip

    # attention scores for KV compression and top-k sparse attention (backends/torch_scores.py)
    attention_columns = torch_scores.attention_columns
    top_k_mask = torch_scores.top_k_mask

    silu = staticmethod(lambda x: F.silu(x))
    relu = staticmethod(lambda x: F.relu(x))

    def gelu(self, x, approximate: bool = False):
        return F.gelu(x, approximate="tanh" if approximate else "none")

    def reshape(self, x, shape):
        return x.reshape(shape)

    def transpose(self, x, axes):
        return x.permute(*axes)

    def mask(self, keep: np.ndarray):
        """A boolean numpy mask as sdpa takes it."""
        return torch.from_numpy(keep).to(self.device)

    def positions(self, offset, T: int):
        """Token positions [1 or B, T] from `offset` (an int, or int numpy [B] per row)."""
        if isinstance(offset, np.ndarray):
            return torch.from_numpy(offset[:, None] + np.arange(T)).to(self.device)
        return torch.arange(offset, offset + T, device=self.device)[None]

    def zeros(self, shape, like):
        # Zeros are buffers that outlive a model call (a KV cache, the service's chunk pool, which
        # grows inside one): made as plain tensors, not inference ones, so that writing into them
        # outside a call (a swapped chunk read back) is allowed.
        with torch.inference_mode(False):
            return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def split(self, x, sizes):
        """Split the last axis into consecutive pieces of the given sizes."""
        return torch.split(x, list(sizes), dim=-1)

    def concatenate(self, xs, axis: int):
        return torch.cat(xs, dim=axis)

    def take(self, x, idx):
        """Entries idx (an int array) of the last axis."""
        return torch.index_select(x, -1, idx)

    def take_tokens(self, x, idx):
        """Entries idx (an int array) of axis 1: tokens of a KV array [H, N, hd] (as x[:, idx] reads
        them; a torch index_select is ~6x faster than the indexing for the server's gathers)."""
        return torch.index_select(x, 1, idx)

    def take_rows(self, x, idx):
        """Rows idx of x [N, ...]."""
        return torch.index_select(x, 0, idx)

    def add_rows(self, x, idx, y):
        """x with y added to its rows idx (distinct), as a new array."""
        return x.index_add(0, idx, y)

    sigmoid = staticmethod(lambda x: torch.sigmoid(x))

    def last_token(self, x):
        return x[:, -1:, :]
