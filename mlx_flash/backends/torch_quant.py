"""Packed-code helpers of the torch backend: MLX's uint32 packing unpacked and dequantized in torch."""

from __future__ import annotations

from ..quant_spec import QuantSpec

try:
    import torch
except ImportError:  # the torch backend says what to install
    torch = None


def unpack_bits(packed: "torch.Tensor", bits: int) -> "torch.Tensor":
    """uint32 words -> integer codes, lowest bits first (MLX's packing), [..., n*32/bits] (uint8 for
    2/4/8 bits, int32 otherwise)."""
    if 8 % bits == 0:  # 2/4/8 bits: work on the words' bytes (little-endian), 8x less data than int64
        per = 8 // bits
        b = packed.contiguous().view(torch.uint8)
        shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
        codes = (b.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 32 // bits)
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
    # bias + code * scale in one pass (the same float32 products and sums as written out)
    w = torch.addcmul(biases.to(torch.float32).unsqueeze(-1), c, scales.to(torch.float32).unsqueeze(-1))
    return w.reshape(shape).to(dtype)


def int4pack(codes, scales, biases, quant: QuantSpec):
    """Exact re-expression of affine codes for torch's int4 kernel, which computes
    (c - 8) * scale + zero per group. 4-bit: zero = bias + 8 * scale. 8-bit codes c = 16 h + l
    become two 4-bit matrices, h with scale 16 s and l with scale s, whose outputs are summed."""
    n, k = codes.shape
    if n % 8 or k % quant.group_size or quant.group_size not in (32, 64, 128, 256):
        return None

    def pack(c, s, z):
        sz = torch.stack([s.t(), z.t()], dim=-1).contiguous().to(torch.bfloat16)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1), sz

    if quant.bits == 4:
        w4, sz = pack(codes, scales, biases + 8 * scales)
        return "int4", w4, sz
    hi, lo = codes >> 4, codes & 15
    w4, sz = pack(torch.cat([hi, lo]), torch.cat([16 * scales, scales]), torch.cat([128 * scales, biases + 8 * scales]))
    return "int4x2", w4, sz
