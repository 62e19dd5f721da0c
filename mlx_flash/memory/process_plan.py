"""The process planner: the one memory limit split between what the process holds before any
weights (the runtime floor, measured), the KV cache, the work buffers of a forward pass, and the
weights; the weights' share then goes to the FFN planners (sparse/planner.py, moe/planner.py), or
decides resident vs streamed FFN for ffn="auto".

    limit = floor + runtime slack + KV cache + work buffers + weights budget

floor: this process's RSS when planning (interpreter, frameworks, tokenizer, anything the caller
already holds). RUNTIME_SLACK: what a backend allocates on its first forward passes beyond the
floor (thread pools, allocator caches: MLX's buffer cache is capped at MLX_CACHE_LIMIT by the
backend), measured on a 24 KB model. KV cache: `kv_tokens` tokens of every layer's keys and values
in float32. Work buffers: the activations of one prefill chunk (attention scores included).
A limit that cannot hold the floor, the work buffers, 128 tokens of KV and the weights' minimum is
refused, naming the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, MemoryBudgetError
from ..units import fmt
from .limit import MemoryLimit

RUNTIME_SLACK = {"mlx": 48 << 20, "torch": 64 << 20}
# What importing a backend's framework adds to RSS (measured: torch 2.13 CPU 196 MB, MLX 6 MB), checked
# before the import so that a limit torch alone would break is refused instead of OOM-killed.
BACKEND_IMPORT = {"mlx": ("mlx.core", 8 << 20), "torch": ("torch", 200 << 20)}
MLX_CACHE_LIMIT = 32 << 20
MIN_KV_TOKENS = 128
AUTO_KV_SHARE = 0.10  # "auto" context: the model's whole context, or what this share of the limit holds
# Prefill chunks halve (down to MIN_CHUNK) while their buffers take more than this share of the limit:
# under a tight limit the bytes go to weights instead (fewer read per token), and a long prompt
# takes more passes.
WORK_SHARE, MIN_CHUNK = 0.08, 64
_F32 = 4


@dataclass(frozen=True)
class ModelShape:
    """The sizes the plan needs, read from a store's normalized config (every family's)."""
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_width: int  # FFN neurons one token runs (a MoE: its routed experts' together)
    vocab: int

    @classmethod
    def from_config(cls, c: dict) -> "ModelShape":
        D, H = int(c["hidden_size"]), int(c["num_attention_heads"])
        if c.get("num_experts"):
            ffn = int(c["moe_intermediate_size"]) * int(c["num_experts_per_tok"]) \
                + int(c.get("shared_expert_intermediate_size") or 0)
        else:
            ffn = int(c.get("intermediate_size") or c["ffn_dim"])  # OPT names it ffn_dim
        return cls(layers=int(c["num_hidden_layers"]), d_model=D, heads=H,
                   kv_heads=int(c.get("num_key_value_heads") or H), head_dim=int(c.get("head_dim") or D // H),
                   ffn_width=ffn, vocab=int(c["vocab_size"]))


def kv_bytes_per_token(shape: ModelShape) -> int:
    """Keys and values of one token in every layer, float32."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * _F32


def work_bytes(shape: ModelShape, chunk: int, context: int) -> int:
    """Activations alive during one forward pass of `chunk` tokens with `context` tokens cached (an
    upper estimate: hidden states and their norms, q/k/v, attention scores and probabilities, the
    FFN's gate/up/hidden, the last position's logits)."""
    s = shape
    per_token = 6 * s.d_model + (s.heads + 2 * s.kv_heads) * s.head_dim + 3 * s.ffn_width
    return _F32 * (chunk * per_token + 2 * s.heads * chunk * (context + chunk) + s.vocab)


@dataclass
class ProcessPlan:
    limit: MemoryLimit
    floor: int
    slack: int
    kv_tokens: int
    kv_bytes: int
    prefill_chunk: int
    work_bytes: int
    weights_budget: int  # what the weights, predictors, read buffers and caches may hold
    notes: list[str] = field(default_factory=list)

    def account(self) -> dict:
        return {"limit": self.limit.bytes, "limit_meaning": self.limit.how, "runtime_floor": self.floor,
                "runtime_slack": self.slack, "kv_tokens": self.kv_tokens, "kv_cache": self.kv_bytes,
                "prefill_chunk": self.prefill_chunk, "work_buffers": self.work_bytes,
                "weights_budget": self.weights_budget}

    def line(self, weights: str) -> str:
        """One line for stderr: the limit and where it goes; `weights` says what the weights' share holds."""
        return (f"memory: limit {fmt(self.limit.bytes)} ({self.limit.how}) = runtime {fmt(self.floor + self.slack)}"
                f" + KV {fmt(self.kv_bytes)} ({self.kv_tokens} tokens) + buffers {fmt(self.work_bytes)} + weights "
                f"{fmt(self.weights_budget)}: {weights}" + "".join(f"; {n}" for n in self.notes))


def check_backend_room(limit: MemoryLimit, backend: str, rss: int) -> None:
    """Refuse a limit that importing the backend's framework (not imported yet) would exceed."""
    import sys

    module, cost = BACKEND_IMPORT[backend]
    if module not in sys.modules and limit.bytes < rss + cost:
        raise MemoryBudgetError(f"memory budget {fmt(limit.bytes)} is below the {fmt(rss + cost)} this process holds "
                                f"once {backend} is imported ({fmt(rss)} now + about {fmt(cost)} for {module})")


def plan_process(limit: MemoryLimit, floor: int, backend: str, shape: ModelShape, context_limit: int,
                 weights_minimum: int,
                 context: int = 0, prefill_chunk: int = 512) -> ProcessPlan:
    """Split `limit` (see the module docstring). context: KV tokens to plan for (0: auto, the model's
    context or what AUTO_KV_SHARE of the limit holds, at least MIN_KV_TOKENS); weights_minimum: the least the weights need
    (resident tensors and one streamed layer's buffers), to refuse early with the minimum."""
    slack = RUNTIME_SLACK[backend]
    per_tok = kv_bytes_per_token(shape)
    if context:
        if context > context_limit:
            raise ConfigError(f"context {context} is more than the model's {context_limit} tokens")
        kv_tokens = context
    else:
        kv_tokens = min(context_limit, max(MIN_KV_TOKENS, int(limit.bytes * AUTO_KV_SHARE) // per_tok))
    chunk, notes = prefill_chunk, []
    kv_min = per_tok * (kv_tokens if context else min(kv_tokens, MIN_KV_TOKENS))

    def left(chunk_, kv_):
        return limit.bytes - floor - slack - kv_ - work_bytes(shape, chunk_, kv_tokens)

    while chunk > MIN_CHUNK and work_bytes(shape, chunk, kv_tokens) > WORK_SHARE * limit.bytes:
        chunk //= 2
    while chunk > 16 and left(chunk, kv_min) < weights_minimum:  # smaller prefill chunks before refusing
        chunk //= 2
    if chunk != prefill_chunk:
        notes.append(f"prefill chunk {prefill_chunk} -> {chunk} tokens to fit")
    work = work_bytes(shape, chunk, kv_tokens)
    minimum = floor + slack + kv_min + work + weights_minimum
    if limit.bytes < minimum:
        raise MemoryBudgetError(
            f"memory budget {fmt(limit.bytes)} is below the minimum {fmt(minimum)} for this model on this backend "
            f"(runtime {fmt(floor + slack)} measured, KV cache {fmt(kv_min)} for {kv_min // per_tok} tokens, "
            f"buffers {fmt(work)}, weights {fmt(weights_minimum)} at the least)")
    if not context:  # auto: shrink the KV target until the weights' minimum fits
        while kv_tokens > MIN_KV_TOKENS and left(chunk, per_tok * kv_tokens) < weights_minimum:
            kv_tokens = max(MIN_KV_TOKENS, kv_tokens // 2)
    kv, work = per_tok * kv_tokens, work_bytes(shape, chunk, kv_tokens)
    return ProcessPlan(limit=limit, floor=floor, slack=slack, kv_tokens=kv_tokens, kv_bytes=kv, prefill_chunk=chunk,
                       work_bytes=work, weights_budget=left(chunk, kv), notes=notes)
