"""One dataclass of engine knobs; every field is a user-visible option with a safe default."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import ConfigError
from .moe.policies import ONLINE_POLICIES

FFN_MODES = ("resident", "stream", "sparse")


def default_cache_dir() -> str:
    return os.environ.get("MLX_FLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mlx_flash")


@dataclass
class EngineConfig:
    backend: str = "mlx"  # "mlx" (Metal on a Mac, CPU elsewhere) or "torch" (CPU / CUDA)
    device: str | None = None  # backend device override: "cpu", "gpu" (mlx), "cuda" (torch)
    threads: int | None = None  # torch CPU threads (None: torch's default)
    # torch linears: "float32" (exact) or "bfloat16" (fast int4 kernel; approximate, see README)
    torch_dtype: str = "float32"
    ffn: str = "resident"  # "resident": FFN weights in memory; "stream": read from the bundle file per layer;
    # "sparse": LLM in a flash under memory_budget (see sparse_mode)
    sparse_mode: str = "all"  # naive / hybrid / predictor / window / all (mlx_flash.sparse.sparse_ffn)
    memory_budget: str | int = "50%"  # sparse: share of the model's bytes ("50%") or bytes ("300MB")
    window: int = 0  # sparse: tokens whose active neurons stay cached (0: the planner picks, sparse.planner)
    # sparse: "lowrank" (trained, in the store), "gate" (resident 4-bit gate/up: the selection the
    # low-rank predictors approximate) or "dense" (all neurons: exact)
    predictor: str = "lowrank"
    # sparse + predictor "gate": compute gate/up from its resident 4-bit copy and read only the down
    # columns of active neurons (a third of the bytes; approximate unless gate/up are stored 4-bit)
    down_only: bool = False
    expert_policy: str = "edgemoe"  # MoE: expert-cache eviction (edgemoe / lru / lfu / fifo; mlx_flash.moe.policies)
    # MoE: experts of the next layer read ahead per decode step from the store's routing predictor
    # (tools/trace_experts.py); -1: as many as a token routes to when the store has one, else none
    expert_preload: int = -1
    predictor_recall: float | None = None  # sparse: pick the predictors' cuts for this recall (None: as trained)
    precision: str = "source"  # FFN precision when converting: source / f16 / q4 / q8
    io_mode: str = "direct"  # FFN reads in stream mode: "direct" (bypass the page cache) or "buffered"
    io_threads: int | None = None  # reader threads (None: best count from the disk profile)
    prefill_chunk: int = 512  # prompt tokens per forward pass during prefill
    verify_checksums: bool = False  # recompute sha256 of every store file at open
    cache_dir: str = ""  # where converted stores live ("" -> $MLX_FLASH_CACHE or ~/.cache/mlx_flash)

    def __post_init__(self):
        if self.ffn not in FFN_MODES:
            raise ConfigError(f"ffn mode {self.ffn!r} is unknown (choose one of: {', '.join(FFN_MODES)})")
        if self.window < 0:
            raise ConfigError(f"window must be >= 1, or 0 for the planner's choice (got {self.window})")
        if self.expert_policy not in ONLINE_POLICIES:
            raise ConfigError(f"expert_policy {self.expert_policy!r} is unknown (choose one of: "
                              f"{', '.join(ONLINE_POLICIES)})")
        if self.expert_preload < -1:
            raise ConfigError(f"expert_preload must be >= 0, or -1 for the default (got {self.expert_preload})")
        if self.predictor not in ("lowrank", "gate", "dense"):
            raise ConfigError(f"predictor {self.predictor!r} is unknown (choose lowrank, gate or dense)")
        if self.io_mode not in ("direct", "buffered"):
            raise ConfigError(f"io_mode {self.io_mode!r} is unknown (choose direct or buffered)")
        if self.io_threads is not None and self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1 (got {self.io_threads})")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1 (got {self.prefill_chunk})")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 (got {self.threads})")
        self.cache_dir = self.cache_dir or default_cache_dir()
