"""FlexGen's cost model (§4.3, Appendix A.3) for two tiers, memory and flash: the time of one block
from the bandwidths and compute speed measured on this machine and a policy.

Per layer, a block's prefill computes every sequence's prompt (`compute.prefill(P)` each) and its
decode step computes every micro-batch (`compute.decode(gpu_batch)` each); a streamed layer also
reads its FFN (`read_s`). With overlap, a streamed layer takes the longer of the two (the read of
layer i + 1 runs while layer i computes), without it their sum; in the row order every micro-batch
reads each streamed layer again. Resident layers only compute.

    block time = sum over layers (prefill layer time + G x decode layer time)
    tokens/s   = block size x G / block time

Memory (bytes, all inside the process limit): resident FFN layers as stored, the block's KV cache
(float32, or 4-bit codes and float16 scales), the block's hidden states between layers, and the
work buffers of one micro-batch's pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.process_plan import ModelShape, kv_bytes_per_token, work_bytes
from .policy import KEY_BLOCK, KV_GROUP, Policy
from .schedule import Order

_F32 = 4


@dataclass(frozen=True)
class ComputeSpeed:
    """Seconds one layer computes, fitted from a short calibration run (offload/calibration.py):
    prefill of one sequence of T tokens: pre_fixed + pre_per_token x T; a decode step of a
    micro-batch of m rows: dec_fixed + dec_per_row x m."""

    pre_fixed: float
    pre_per_token: float
    dec_fixed: float
    dec_per_row: float

    def prefill(self, tokens: int) -> float:
        return self.pre_fixed + self.pre_per_token * tokens

    def decode(self, rows: int) -> float:
        return self.dec_fixed + self.dec_per_row * rows


@dataclass(frozen=True)
class Workload:
    sequences: int
    prompt: int  # tokens per prompt (the longest, for memory; the mean for time is close enough)
    generate: int  # tokens each sequence generates


@dataclass(frozen=True)
class Machine:
    """What the block's placement can use and how fast it moves and computes."""

    room: int  # bytes the policy may place: the limit less the runtime and the engine's fixed weights
    weights_room: int  # of those, what the memory plan's weights share leaves for resident FFN layers
    ffn_layer_bytes: int  # one layer's FFN as stored
    n_layers: int
    read_bps: float  # flash reads of whole layers, bytes/s (the disk profile)
    compute: ComputeSpeed
    shape: ModelShape
    attn_read_bytes: tuple = ()  # per layer: its attention read when it computes (streamed layers), else 0

    def attn_read(self, i: int) -> int:
        return self.attn_read_bytes[i] if self.attn_read_bytes else 0


def kv_bytes(shape: ModelShape, tokens: int, kv_bits: int, sequences: int = 1) -> int:
    """KV of `tokens` tokens (of `sequences` sequences) in every layer, exact (float32) or at kv_bits
    with float16 scales and biases, each sequence's last, incomplete key block kept as float32."""
    if not kv_bits:
        return kv_bytes_per_token(shape) * tokens
    n = shape.layers * shape.kv_heads * shape.head_dim * tokens  # keys (and as many values)
    # codes of both; a float16 scale and bias per channel and 16-token block of keys, per group of values
    tails = sequences * shape.layers * shape.kv_heads * KEY_BLOCK * shape.head_dim * _F32
    return 2 * n * kv_bits // 8 + 4 * n // KEY_BLOCK + 4 * n // min(KV_GROUP, shape.head_dim) + tails


def fits(m: Machine, w: Workload, p: Policy) -> bool:
    return memory_bytes(m, w, p) <= m.room and p.resident_layers * m.ffn_layer_bytes <= m.weights_room


def memory_bytes(m: Machine, w: Workload, p: Policy) -> int:
    """What the policy holds at its peak (see the module docstring)."""
    s = m.shape
    hidden = p.block_size * w.prompt * s.d_model * _F32 * 3  # residual stream, its norm and the layer's output
    work = work_bytes(s, w.prompt, w.prompt + w.generate)  # one sequence's prefill pass
    work = max(work, p.gpu_batch * work_bytes(s, 1, w.prompt + w.generate))
    kv = kv_bytes(s, p.block_size * (w.prompt + w.generate), p.kv_bits, p.block_size)
    return p.resident_layers * m.ffn_layer_bytes + kv + hidden + work


def minimum_bytes(m: Machine, w: Workload) -> int:
    """The least any policy needs: one sequence, nothing resident, exact KV."""
    return memory_bytes(m, w, Policy())


def layer_seconds(compute: float, read: float, p: Policy, reads_per_layer: int) -> float:
    if not read:
        return compute
    read *= reads_per_layer
    return max(compute, read) if p.overlap else compute + read


def block_seconds(m: Machine, w: Workload, p: Policy) -> tuple[float, float]:
    """(prefill, decode) seconds of one full block under policy p."""
    mbs = -(-p.block_size // p.gpu_batch)
    pre_c = p.block_size * m.compute.prefill(w.prompt)
    dec_c = mbs * m.compute.decode(p.gpu_batch)
    pre = dec = 0.0
    for i in range(m.n_layers):
        rd = ((m.ffn_layer_bytes if i >= p.resident_layers else 0) + m.attn_read(i)) / m.read_bps
        pre += layer_seconds(pre_c, rd, p, p.block_size if p.order is Order.ROW else 1)
        dec += layer_seconds(dec_c, rd, p, mbs if p.order is Order.ROW else 1)
    return pre, dec * w.generate


def tokens_per_s(m: Machine, w: Workload, p: Policy) -> float:
    pre, dec = block_seconds(m, w, p)
    return p.block_size * w.generate / (pre + dec)


def run_seconds(m: Machine, w: Workload, p: Policy) -> float:
    """Predicted seconds for the whole workload: full blocks, and a last partial one."""
    full, rest = divmod(w.sequences, p.block_size)
    t = full * sum(block_seconds(m, w, p))
    if rest:
        part = Policy(min(p.gpu_batch, rest), -(-rest // min(p.gpu_batch, rest)), p.resident_layers, p.kv_bits,
                      p.order, p.overlap)
        t += sum(block_seconds(m, w, part))
    return t
