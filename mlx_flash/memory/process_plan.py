"""The process planner: the one memory limit split between what the process holds before any
weights (the runtime floor, measured), the KV cache, the work buffers of a forward pass, and the
weights; the weights' share then goes to the FFN planners (sparse/planner.py, moe/planner.py), or
decides resident vs streamed FFN for ffn="auto".

    limit = floor + runtime slack + KV cache + work buffers + reader buffers + weights budget

floor: this process's RSS when planning (interpreter, frameworks, tokenizer, anything the caller
already holds). RUNTIME_SLACK: what a backend allocates on its first forward passes beyond the
floor (thread pools, allocator caches: MLX's buffer cache is capped at backends/mlx.py's
MLX_CACHE_LIMIT), measured on a 24 KB model. KV cache: `kv_tokens` tokens of every layer's keys and values
in float32. Work buffers: the activations of one prefill chunk (attention scores included).
Reader buffers: what the reader pools of streamed weights hold (their threads' scratch buffers and
stacks: store/reader_pool.py), counted whether or not the plan streams, so that the minimum is one
number (at the minimum the weights stream).
A limit that cannot hold the floor, the slack, the work buffers of a 16-token chunk, 128 tokens of
KV and the weights' minimum is refused, naming the minimum: one number for a model and backend
whatever limit was tried, and a run given that number is planned (the floor is measured again in
every process: the named minimum carries FLOOR_JITTER for it, rounded up).
Where the KV share holds fewer tokens than the context, plan_tiers keeps that share as a resident
window and plans the older tokens on flash (models/kv_tiers.py): their read buffers and the attention
buffers over the whole context come out of the weights' share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import ConfigError, MemoryBudgetError
from ..units import fmt
from ..models.kv_tiers import EVICT_STEP
from .limit import MemoryLimit
from .import_cost import ImportKilled, measured_import_cost

RUNTIME_SLACK = {"mlx": 48 << 20, "torch": 64 << 20}
# What importing a backend's framework adds to RSS (torch 2.13 CPU: 208 MB on one machine, about 60 MB
# more on another; MLX 6 MB), checked before the import so that a limit the import alone would break is
# refused instead of OOM-killed; measured on this machine (import_cost.py) when a limit is near it.
BACKEND_IMPORT = {"mlx": ("mlx.core", 8 << 20), "torch": ("torch", 200 << 20)}
# What the process reaches between the backend's import and the plan: parsing tokenizer.json peaks
# 46 MB above the RSS before it (the default model's 49k-token tokenizer, 3.5 MB of JSON; 19 MB of it
# stays). A limit below the import plus this is refused before the import too: planning at it would
# first push the process over it (measured: a 61 MB limit on MLX peaked at 91 MB before its refusal,
# a 255 MB one on torch at 279 MB).
BEFORE_PLAN = 48 << 20
# The floor is measured in each process and moves between runs (at most 0.5 MB over eight runs of the
# default model per backend, 2 to 16 threads): the minimum a refusal names carries this much more, so
# that a run given that number is planned, not refused by a floor a little higher than the last.
FLOOR_JITTER = 2 << 20
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
            ffn = int(c["moe_intermediate_size"]) * int(c["num_experts_per_tok"]) + int(
                c.get("shared_expert_intermediate_size") or 0
            )
        else:
            ffn = int(c.get("intermediate_size") or c["ffn_dim"])  # OPT names it ffn_dim
        return cls(
            layers=int(c["num_hidden_layers"]),
            d_model=D,
            heads=H,
            kv_heads=int(c.get("num_key_value_heads") or H),
            head_dim=int(c.get("head_dim") or D // H),
            ffn_width=ffn,
            vocab=int(c["vocab_size"]),
        )


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
    reader_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    # KV tiers (plan_tiers): the context one sequence may hold when more than kv_tokens, the window
    # (kv_tokens) resident and the rest on flash; 0: every token resident
    tier_context: int = 0
    tier_reads: int = 0  # the read buffers of the tokens on flash
    tier_disk: int = 0  # the file one sequence's KV takes on flash
    tier_bits: int = 0  # the width of the tokens on flash (0: float32, exact)
    # what the disk under the tiers' folder cut the context to, in words (plan_tiers); "": it did not
    disk_short: str = ""

    @property
    def context(self) -> int:
        """Most tokens one sequence's KV may hold."""
        return self.tier_context or self.kv_tokens

    def account(self) -> dict:
        return {
            "limit": self.limit.bytes,
            "limit_meaning": self.limit.how,
            "runtime_floor": self.floor,
            "runtime_slack": self.slack,
            "kv_tokens": self.kv_tokens,
            "kv_cache": self.kv_bytes,
            "prefill_chunk": self.prefill_chunk,
            "work_buffers": self.work_bytes,
            "reader_buffers": self.reader_bytes,
            "weights_budget": self.weights_budget,
            "kv_context": self.context,
            "kv_read_buffers": self.tier_reads,
            "kv_on_flash": self.tier_disk,
            "kv_disk_short": self.disk_short,
        }

    def line(self, weights: str) -> str:
        """One line for stderr: the limit and where it goes; `weights` says what the weights' share holds."""
        return (
            f"memory: limit {fmt(self.limit.bytes)} ({self.limit.how}) = runtime {fmt(self.floor + self.slack)}"
            f" + KV {fmt(self.kv_bytes + self.tier_reads)} ({self._kv_words()}) + buffers {fmt(self.work_bytes)}"
            f" + readers {fmt(self.reader_bytes)} + weights "
            f"{fmt(self.weights_budget)}: {weights}" + "".join(f"; {n}" for n in self.notes)
        )

    def _kv_words(self) -> str:
        if not self.tier_context:
            return f"{self.kv_tokens} tokens"
        return (
            f"{self.kv_tokens} tokens resident, {fmt(self.kv_bytes)}, and {fmt(self.tier_reads)} of read buffers "
            f"for a {self.tier_context}-token context, the older tokens on flash"
            + (f" at {self.tier_bits} bits" if self.tier_bits else "")
            + f": {fmt(self.tier_disk)} of disk"
        )


MIN_WINDOW = 128  # the least resident window beside a forward's chunk worth keeping KV on flash for


def plan_tiers(
    plan: ProcessPlan,
    shape: ModelShape,
    want: int,
    weights_minimum: int,
    disk_free: int,
    asked: bool = True,
    flash_per_token: float = 0,
    bits: int = 0,
    folder: str = "",
) -> ProcessPlan:
    """`plan` with KV tiers when its KV share holds fewer than `want` tokens: the share keeps a window
    of recent tokens resident (at least MIN_WINDOW beside a prefill chunk), the older ones go to
    flash, read back a layer at a time into two read buffers of a layer's whole context. Those and the
    attention buffers over that context come from the weights' share, down to the weights' minimum;
    prefill chunks halve while their attention buffers take more than WORK_SHARE of the limit. What
    does not fit halves the context, until it fits or the share holds it resident (then the plan is
    unchanged). A context whose file is more than `disk_free` on the disk of `folder` (where the files
    go) is refused naming both when `asked` (a user's --context); else the context becomes what the
    disk holds (in whole moves to flash, EVICT_STEP), or what the share holds resident, and the plan
    says so (`disk_short`, one of its notes): a context cut by a full disk is never a silent one.
    `flash_per_token`: the bytes a token takes on flash (and in a read buffer), every layer, when
    compressed to `bits` (default: float32, as resident)."""
    per_tok = kv_bytes_per_token(shape)
    on_flash = flash_per_token or per_tok
    cut = 0  # the longest context memory holds with tiers, when the disk holds less of it
    while plan.kv_tokens < want:  # the longest context up to `want` whose buffers fit
        reads = int(2 * on_flash / shape.layers * want)  # two buffers of one layer's keys and values
        chunk = plan.prefill_chunk  # halved (as plan_process does) while its attention buffers over `want`
        while chunk > MIN_CHUNK and work_bytes(shape, chunk, want) > WORK_SHARE * plan.limit.bytes:  # are many
            chunk //= 2
        work = work_bytes(shape, chunk, want)
        room = plan.limit.bytes - plan.floor - plan.slack - plan.reader_bytes - reads - work - weights_minimum
        resident = max(plan.kv_tokens, chunk + MIN_WINDOW)  # the KV share, or the least window beside a chunk
        if per_tok * resident > room:
            want //= 2
            continue
        if asked or on_flash * want <= disk_free:
            break
        cut = cut or want
        want = min(want - 1, disk_tokens(disk_free, on_flash))  # as much as the disk holds, if memory does
    else:
        return (
            dataclasses.replace(plan, **_cut_by_disk(plan, plan.context, cut, on_flash, disk_free, folder))
            if cut
            else plan
        )
    disk = int(on_flash * want)
    if disk > disk_free:
        holds = disk_tokens(disk_free, on_flash)
        raise ConfigError(f"{disk_words(folder, disk_free, holds, want, disk)}; free some, or lower --context")
    tiered = dataclasses.replace(
        plan,
        kv_tokens=resident,
        kv_bytes=per_tok * resident,
        prefill_chunk=chunk,
        work_bytes=work,
        weights_budget=room + weights_minimum - per_tok * resident,
        tier_context=want,
        tier_reads=reads,
        tier_disk=disk,
        tier_bits=bits,
        notes=plan.notes
        + (
            [f"prefill chunk {plan.prefill_chunk} -> {chunk} tokens for attention over the context"]
            if chunk != plan.prefill_chunk
            else []
        ),
    )
    return dataclasses.replace(tiered, **_cut_by_disk(tiered, want, cut, on_flash, disk_free, folder))


def disk_tokens(disk_free: int, on_flash: float) -> int:
    """Tokens a file in `disk_free` bytes holds, in whole moves to flash (a compressed file is sized
    in blocks of that many tokens)."""
    return int(disk_free // on_flash) // EVICT_STEP * EVICT_STEP


def disk_words(folder: str, free: int, holds: int, wanted: int, needs: int) -> str:
    """Why the disk limits a context, as a refusal and the plan's note say it."""
    where = f"the KV tier folder {folder}" if folder else "the disk"
    return f"{where} has {fmt(free)} free, enough for {holds} tokens (a context of {wanted} needs {fmt(needs)})"


def _cut_by_disk(plan: ProcessPlan, context: int, cut: int, on_flash: float, free: int, folder: str) -> dict:
    """The fields that say a context of `cut` tokens became `context` for want of disk (none when `cut`
    is 0)."""
    if not cut:
        return {}
    words = disk_words(folder, free, context, cut, int(on_flash * cut))
    return {"disk_short": words, "notes": plan.notes + [f"context {context} tokens, not {cut}: {words}"]}


def check_backend_room(limit: MemoryLimit, backend: str, rss: int, cache_dir: str) -> None:
    """Refuse a limit that the process would pass before it can plan: importing the backend's
    framework (when not imported yet; measured on this machine when the limit is close enough for
    the estimate to matter: memory/import_cost.py) and loading the tokenizer (BEFORE_PLAN)."""
    import sys

    module, cost = BACKEND_IMPORT[backend]
    how = "about"
    if module in sys.modules:
        cost = 0
    elif limit.bytes < rss + BEFORE_PLAN + FLOOR_JITTER + 2 * cost:
        try:
            cost, how = measured_import_cost(module, cost, cache_dir, backend), "measured here:"
        except ImportKilled as e:
            raise MemoryBudgetError(f"memory budget {fmt(limit.bytes)} does not hold importing {module}: {e}") from None
    if limit.bytes < rss + cost + BEFORE_PLAN:  # (named with FLOOR_JITTER: RSS now moves between runs too)
        raise MemoryBudgetError(
            f"memory budget {fmt(limit.bytes)} is below the {fmt(_stated(rss + cost + BEFORE_PLAN))} this process "
            f"reaches on {backend} before it can plan any model ({fmt(rss)} now"
            + (f" + {how} {fmt(cost)} for {module}" if cost else "")
            + f" + about {fmt(BEFORE_PLAN)} loading a tokenizer); the minimum for a model is more"
        )


def _stated(n: int) -> int:
    """A minimum as a refusal names it: with FLOOR_JITTER, rounded up to what fmt() writes (0.1 MB),
    so that the number written back as a limit is not below the minimum."""
    return -(-(n + FLOOR_JITTER) // 100_000) * 100_000


def plan_process(
    limit: MemoryLimit,
    floor: int,
    backend: str,
    shape: ModelShape,
    context_limit: int,
    weights_minimum: int,
    context: int = 0,
    prefill_chunk: int = 512,
    readers: int = 0,
) -> ProcessPlan:
    """Split `limit` (see the module docstring). context: KV tokens to plan for (0: auto, the model's
    context or what AUTO_KV_SHARE of the limit holds, at least MIN_KV_TOKENS); weights_minimum: the least the
    weights need
    (resident tensors and one streamed layer's buffers), to refuse early with the minimum; readers: the
    reader pools' bytes (see the module docstring)."""
    slack = RUNTIME_SLACK[backend]
    per_tok = kv_bytes_per_token(shape)
    if context:
        if context > context_limit:
            raise ConfigError(f"context {context} is more than the model's {context_limit} tokens")
        target = context
    else:
        target = min(context_limit, max(MIN_KV_TOKENS, int(limit.bytes * AUTO_KV_SHARE) // per_tok))
    # the least KV the plan may keep: an explicit context whole, else MIN_KV_TOKENS
    least = context or min(target, MIN_KV_TOKENS)
    smallest_chunk = min(prefill_chunk, 16)

    def left(chunk_, tokens):
        return limit.bytes - floor - slack - readers - per_tok * tokens - work_bytes(shape, chunk_, tokens)

    # The minimum depends on the model and backend alone (not on the limit tried): the least KV, the
    # buffers of the smallest chunk over it, the weights' minimum.
    minimum = floor + slack + readers + per_tok * least + work_bytes(shape, smallest_chunk, least) + weights_minimum
    if limit.bytes < minimum:
        raise MemoryBudgetError(  # (FLOOR_JITTER keeps the two numbers apart as fmt() writes them)
            f"memory budget {fmt(limit.bytes)} is below the minimum {fmt(_stated(minimum))} for this model on this "
            f"backend (runtime {fmt(floor + slack)} measured, KV cache {fmt(per_tok * least)} for {least} tokens, "
            f"buffers {fmt(work_bytes(shape, smallest_chunk, least))}, readers {fmt(readers)}, "
            f"weights {fmt(weights_minimum)} at the least, "
            f"{fmt(FLOOR_JITTER)} for the runtime's run-to-run difference)"
        )
    chunk, notes = prefill_chunk, []
    while chunk > MIN_CHUNK and work_bytes(shape, chunk, target) > WORK_SHARE * limit.bytes:
        chunk //= 2
    while chunk > smallest_chunk and left(chunk, least) < weights_minimum:  # smaller chunks before less KV
        chunk //= 2
    if chunk != prefill_chunk:
        notes.append(f"prefill chunk {prefill_chunk} -> {chunk} tokens to fit")
    kv_tokens = target
    while kv_tokens > least and left(chunk, kv_tokens) < weights_minimum:  # auto: the KV target shrinks to fit
        kv_tokens = max(least, kv_tokens // 2)
    return ProcessPlan(
        limit=limit,
        floor=floor,
        slack=slack,
        kv_tokens=kv_tokens,
        kv_bytes=per_tok * kv_tokens,
        prefill_chunk=chunk,
        work_bytes=work_bytes(shape, chunk, kv_tokens),
        weights_budget=left(chunk, kv_tokens),
        reader_bytes=readers,
        notes=notes,
    )
