"""torch backend: the same op names and semantics as backends/mlx.py, implemented with torch.

CPU here, CUDA when present. Activations and the residual stream are float32. 4-bit linears run
on torch's weight-only int4 kernel, which takes bfloat16 inputs and bfloat16 scales: that rounding
is the only numerical difference from the MLX backend (measured: perplexity agrees to ~1e-3).
Other quantized weights are dequantized once into bfloat16 (CPU) / float16 (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..store.manifest import QuantSpec

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the backend module stays importable so the error can say what to install
    torch = None

NAME = "torch"


@dataclass
class Weight:
    kind: str  # "int4" (packed for torch's int4 kernel) or "dense"
    w: "torch.Tensor"  # int4: packed; dense: [out, in] in the matmul dtype
    scale_zeros: "torch.Tensor | None"
    group_size: int
    out_features: int
    bias: "torch.Tensor | None"
    # The stored quantized triple, kept for embedding lookups (rows dequantized on demand).
    q: tuple | None = None
    quant: QuantSpec | None = None


def unpack_bits(packed: "torch.Tensor", bits: int) -> "torch.Tensor":
    """uint32 words -> integer codes, lowest bits first (MLX's packing), as int32 [..., n*32/bits]."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64, device=packed.device) * bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.int32)


def dequantize(packed, scales, biases, quant: QuantSpec, dtype) -> "torch.Tensor":
    codes = unpack_bits(packed, quant.bits)
    g = quant.group_size
    shape = codes.shape
    c = codes.reshape(*shape[:-1], shape[-1] // g, g).to(torch.float32)
    w = c * scales.to(torch.float32).unsqueeze(-1) + biases.to(torch.float32).unsqueeze(-1)
    return w.reshape(shape).to(dtype)


class TorchOps:
    name = NAME

    def __init__(self, device: str | None = None, threads: int | None = None):
        if torch is None:
            raise ConfigError("backend 'torch' needs PyTorch: pip install 'mlx-flash-engine[torch]' (torch==2.13.0)")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if threads:
            torch.set_num_threads(threads)
        self.act_dtype = torch.float32
        # bfloat16 is what torch's CPU int4 kernel and fast CPU GEMMs want; CUDA prefers float16.
        self.mm_dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16

    def describe(self) -> str:
        return f"torch {torch.__version__} ({self.device}, {torch.get_num_threads()} threads)"

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

    def weight(self, parts: dict, quant: QuantSpec | None, transposed: bool = False, dtypes: dict | None = None) -> Weight:
        dtypes = dtypes or {}
        bias = self.array(parts["bias"], dtypes.get("bias")) if parts.get("bias") is not None else None
        if quant is None:
            w = self.array(parts["weight"], dtypes.get("weight"), cast=False)
            w = (w.t() if transposed else w).contiguous().to(self.mm_dtype)
            return Weight("dense", w, None, 0, w.shape[0], bias)
        packed = torch.from_numpy(np.ascontiguousarray(parts["weight"]).view(np.int32)).to(self.device)
        scales = self.array(parts["scales"], dtypes.get("scales"))
        biases = self.array(parts["biases"], dtypes.get("biases"))
        q = (packed, scales, biases)
        if quant.bits == 4 and not transposed and self.device.type == "cpu":
            codes = unpack_bits(packed, 4)  # [out, in]
            n, k = codes.shape
            if n % 8 == 0 and k % quant.group_size == 0:
                # torch's int4 kernel computes (code - 8) * scale + zero; MLX computes code * scale + bias.
                zeros = biases + 8 * scales
                sz = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous().to(torch.bfloat16)
                w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
                return Weight("int4", w4, sz, quant.group_size, n, bias, q, quant)
        w = dequantize(packed, scales, biases, quant, self.mm_dtype)
        w = (w.t() if transposed else w).contiguous()
        return Weight("dense", w, None, 0, w.shape[0], bias, q, quant)

    def to_numpy(self, x) -> np.ndarray:
        return x.detach().to(torch.float32).cpu().numpy()

    def tokens(self, ids):
        return torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(1, -1), device=self.device)

    def eval(self, *xs) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- ops ----------------------------------------------------------------------------------
    def linear(self, x, w: Weight):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.mm_dtype)
        if w.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w.w, w.group_size, w.scale_zeros)
        else:
            y = x2 @ w.w.t()
        y = y.to(self.act_dtype).reshape(*shape[:-1], w.out_features)
        return y + w.bias if w.bias is not None else y

    def embedding(self, w: Weight, ids):
        if w.q is None:
            return F.embedding(ids, w.w).to(self.act_dtype)
        packed, scales, biases = w.q
        return dequantize(packed[ids], scales[ids], biases[ids], w.quant, self.act_dtype)

    def rms_norm(self, x, weight, eps: float):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def layer_norm(self, x, weight, bias, eps: float):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def rope(self, x, dims: int, traditional: bool, base: float, offset: int, scale: float = 1.0):
        """Same semantics as mx.fast.rope: rotate the first `dims` features of x [B, H, T, hd]."""
        T = x.shape[-2]
        inv = base ** (-torch.arange(0, dims, 2, dtype=torch.float32, device=x.device) / dims)
        pos = (torch.arange(offset, offset + T, dtype=torch.float32, device=x.device) * scale)
        ang = pos[:, None] * inv[None, :]  # [T, dims/2]
        cos, sin = torch.cos(ang), torch.sin(ang)
        xr, rest = x[..., :dims].float(), x[..., dims:]
        if traditional:  # pairs (0,1), (2,3), ...
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
        else:  # halves (0, dims/2), ...
            x1, x2 = xr[..., : dims // 2], xr[..., dims // 2:]
            out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        out = out.to(x.dtype)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def sdpa(self, q, k, v, scale: float, causal: bool):
        T, S = q.shape[-2], k.shape[-2]
        mask = None
        if causal and T > 1:
            # Lower-right alignment (as mx.fast): query t sees keys up to S - T + t.
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    silu = staticmethod(lambda x: F.silu(x))
    relu = staticmethod(lambda x: F.relu(x))

    def gelu(self, x, approximate: bool = False):
        return F.gelu(x, approximate="tanh" if approximate else "none")

    def reshape(self, x, shape):
        return x.reshape(shape)

    def transpose(self, x, axes):
        return x.permute(*axes)

    def arange(self, start: int, stop: int):
        return torch.arange(start, stop, device=self.device)[None]

    def zeros(self, shape, like):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def concatenate(self, xs, axis: int):
        return torch.cat(xs, dim=axis)

    def last_token(self, x):
        return x[:, -1:, :]

