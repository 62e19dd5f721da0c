"""FlexGen's cost model (§4.3, Appendix A.3) for two tiers, memory and flash: the time of one block
from the bandwidths and compute speed measured on this machine and a policy.

Per layer, a block's prefill computes every sequence's prompt (`compute.prefill(P)` each) and its
decode step computes every micro-batch (`compute.decode(gpu_batch)` each); a streamed layer also
reads its FFN (`read_s`), and a block whose last micro-batches keep their KV on flash reads their
held KV every layer and step (and writes their prompts' KV in prefill). With overlap, a streamed
layer takes the longer of the two (the read of layer i + 1 runs while layer i computes), without it
their sum; in the row order every micro-batch reads each streamed layer again. Resident layers only compute.

    block time = sum over layers (prefill layer time + G x decode layer time)
    tokens/s   = block size x G / block time

Memory (bytes, all inside the process limit): resident FFN layers as stored, the KV cache of the
block's sequences held in memory (float32, or 4-bit codes and float16 scales) and, when some are on
flash, one micro-batch's layer of it read in and assembled (twice: the next one is read ahead), the
block's hidden states between layers, and the work buffers of one micro-batch's pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..memory.process_plan import ModelShape, kv_bytes_per_token, work_bytes
from .policy import KEY_BLOCK, KV_GROUP, Policy
from ..batching.schedule import Order

_F32 = 4
# A prefill pass packs several sequences' prompt chunks up to this many tokens when the room holds
# its buffers: the product kernels compute about a fifth more tokens a second over 256 rows than
# over 64 (python -m mlx_flash.bench batch-passes --prompt-tokens 64 --prompts 1,4).
PACKED_PASS = 256


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


def memory_bytes(m: Machine, w: Workload, p: Policy, pass_tokens: int = 0) -> int:
    """What the policy holds at its peak (see the module docstring), its prefill passes of
    `pass_tokens` tokens (0: one sequence's prompt)."""
    s = m.shape
    hidden = p.block_size * w.prompt * s.d_model * _F32 * 3  # residual stream, its norm and the layer's output
    work = work_bytes(s, max(w.prompt, pass_tokens), w.prompt + w.generate)  # one prefill pass
    work = max(work, p.gpu_batch * work_bytes(s, 1, w.prompt + w.generate))
    held = p.block_size - flash_rows(p)
    kv = kv_bytes(s, held * (w.prompt + w.generate), p.kv_bits, held) if held else 0
    if p.kv_on_flash:  # the micro-batch computing and the one read ahead: held keys read, then assembled
        kv += 4 * p.gpu_batch * (w.prompt + w.generate) * kv_bytes_per_token(s) // s.layers
    return p.resident_layers * m.ffn_layer_bytes + kv + hidden + work


def prefill_pass(m: Machine, w: Workload, p: Policy) -> int:
    """Tokens of one prefill pass of policy p's blocks: PACKED_PASS (several sequences' chunks in one
    pass) when prompts are shorter and the room holds that pass's buffers beside the rest of the
    policy, else 0 (a pass of one sequence's chunk). The time model does not count the gain."""
    if w.prompt >= PACKED_PASS or p.block_size < 2:
        return 0
    return PACKED_PASS if memory_bytes(m, w, p, PACKED_PASS) <= m.room else 0


def flash_rows(p: Policy) -> int:
    """Sequences of a full block whose KV is on flash."""
    return p.kv_on_flash * p.gpu_batch


def kv_flash_seconds(m: Machine, w: Workload, p: Policy) -> tuple[float, float]:
    """(prefill, decode step) seconds of one layer's KV traffic to flash: the prompts' KV written, the
    held KV read (at its mean length over the run)."""
    per_token = kv_bytes_per_token(m.shape) / m.shape.layers / m.read_bps
    rows = flash_rows(p)
    return rows * w.prompt * per_token, rows * (w.prompt + w.generate / 2) * per_token


def minimum_bytes(m: Machine, w: Workload) -> int:
    """The least any policy needs: one sequence, nothing resident, its exact KV in memory or on flash."""
    return min(memory_bytes(m, w, Policy()), memory_bytes(m, w, Policy(kv_on_flash=1)))


def layer_seconds(compute: float, read: float, p: Policy, reads_per_layer: int, kv: float = 0.0) -> float:
    """One layer's time: its compute and its reads (weights once per read, the KV on flash once)."""
    read = read * reads_per_layer + kv
    if not read:
        return compute
    return max(compute, read) if p.overlap else compute + read


def block_seconds(m: Machine, w: Workload, p: Policy) -> tuple[float, float]:
    """(prefill, decode) seconds of one full block under policy p."""
    mbs = -(-p.block_size // p.gpu_batch)
    pre_c = p.block_size * m.compute.prefill(w.prompt)
    dec_c = mbs * m.compute.decode(p.gpu_batch)
    kv_pre, kv_dec = kv_flash_seconds(m, w, p)
    pre = dec = 0.0
    for i in range(m.n_layers):
        rd = ((m.ffn_layer_bytes if i >= p.resident_layers else 0) + m.attn_read(i)) / m.read_bps
        pre += layer_seconds(pre_c, rd, p, p.block_size if p.order is Order.ROW else 1, kv_pre)
        dec += layer_seconds(dec_c, rd, p, mbs if p.order is Order.ROW else 1, kv_dec)
    return pre, dec * w.generate


def tokens_per_s(m: Machine, w: Workload, p: Policy) -> float:
    pre, dec = block_seconds(m, w, p)
    return p.block_size * w.generate / (pre + dec)


def run_seconds(m: Machine, w: Workload, p: Policy) -> float:
    """Predicted seconds for the whole workload: full blocks, and a last partial one."""
    full, rest = divmod(w.sequences, p.block_size)
    t = full * sum(block_seconds(m, w, p))
    if rest:
        gb = min(p.gpu_batch, rest)
        nb = -(-rest // gb)
        part = replace(p, gpu_batch=gb, num_batches=nb, kv_on_flash=min(p.kv_on_flash, nb))
        t += sum(block_seconds(m, w, part))
    return t
