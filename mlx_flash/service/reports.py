"""What a service reports: one call's costs (CallReport) and the service's counters (ServiceStats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .restore import RestoreReport


@dataclass
class CallReport:
    """What one call cost: switch_s is the time until the context was ready to prefill its new
    tokens (making room, reading and recomputing its chunks), the paper's switching latency."""

    context: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV the context already held
    switch_s: float = 0.0
    evicted_chunks: int = 0
    written_chunks: int = 0
    restore: RestoreReport = field(default_factory=RestoreReport)
    moves_before: object = None  # the chunk-move counters when the call began (kv_memory.MoveCounts)


@dataclass
class ServiceStats:
    kv_budget: int
    chunk_tokens: int
    chunk_bytes: int
    slots: int
    slots_free: int
    contexts: int
    contexts_resident: int  # every chunk in memory
    contexts_swapped: int  # at least one chunk only on flash
    coded_bytes: int = 0  # the arena of compressed chunks (kv_compression), and what its chunks take
    coded_bytes_used: int = 0
    calls: int = 0
    cache_hits: int = 0  # calls that reused at least one held token
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunks_written: int = 0
    chunks_read: int = 0
    chunks_recomputed: int = 0
    bad_swap_files: int = 0
