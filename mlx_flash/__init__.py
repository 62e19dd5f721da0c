"""mlx_flash: run language models larger than memory by streaming weights from flash.

Public API:
  load                    a model -> Engine (generate / stream_generate; per-token stats in engine.last)
  FlashOptions            options of the sparse FFN (LLM in a flash): load(..., flash=FlashOptions(...))
  ExpertOptions           options of streamed experts (EdgeMoE): load(..., experts=ExpertOptions(...))
  IOOptions               how FFN bytes are read: load(..., io=IOOptions(...))
  Policy                  a throughput policy (batch shape, weights held, KV width, order) for
                          engine.generate_batch(prompts, ..., policy=Policy(...)) (FlexGen)
  Service                 many chat contexts on one engine, their KV in chunks swapped to flash (LLMS)
  EngineConfig            every option of load() in one dataclass (load_config(model, config))
  memory_plan             how an engine's memory budget was split (bytes)
  expert_cache_stats      hits and misses of a MoE engine's expert cache, per layer
  convert                 GGUF / HF / mlx-community model -> store (python -m mlx_flash.convert)
  moefy                   a dense Llama-family model -> a MoE-fied copy with trained routers (tools/moefy.py)
  sparsity_thresholds     measure a model's activation-sparsity thresholds for load(..., sparsity=s)
                          (python -m mlx_flash.sparsify)
  profile_disk            random-read throughput by chunk size x threads, and latency (python -m mlx_flash.profile_disk)
  default_profile         the disk profile load() uses (saved, or a quick probe run once)
  best_threads            reader threads a profile gives a chunk size
  coalesce_gap            the gap below which a profile's disk is cheaper to read through than to skip
  FlashError and subclasses: typed errors with one-line messages

Commands: python -m mlx_flash.chat, python -m mlx_flash.serve, python -m mlx_flash.batch,
python -m mlx_flash.convert, python -m mlx_flash.verify, python -m mlx_flash.profile_disk,
python -m mlx_flash.sparsify (console scripts mlx-flash-chat, -serve, -batch, -convert, -verify,
-profile-disk, -sparsify).
"""

from .api import load, load_config
from .config import EngineConfig
from .convert import convert
from .errors import (
    ConfigError,
    ContextLengthError,
    ContextNotFoundError,
    FlashError,
    MemoryBudgetError,
    ModelFileError,
    ModelNotFoundError,
    StoreError,
    UnsupportedModelError,
)
from .offload import Policy
from .options import ExpertOptions, FlashOptions, IOOptions
from .service import Service
from .stats import expert_cache_stats, memory_plan
from .store.disk_profile import best_threads, coalesce_gap, default_profile, profile_disk

__version__ = "0.1.0"
__all__ = [
    "load",
    "load_config",
    "Policy",
    "Service",
    "EngineConfig",
    "FlashOptions",
    "ExpertOptions",
    "IOOptions",
    "memory_plan",
    "expert_cache_stats",
    "convert",
    "moefy",
    "sparsity_thresholds",
    "profile_disk",
    "default_profile",
    "best_threads",
    "coalesce_gap",
    "FlashError",
    "ConfigError",
    "ContextLengthError",
    "ContextNotFoundError",
    "MemoryBudgetError",
    "ModelFileError",
    "ModelNotFoundError",
    "StoreError",
    "UnsupportedModelError",
]


OFFLINE = ("moefy", "sparsity_thresholds")  # in calibrate/: imported on first use, never by inference


def __getattr__(name: str):
    if name in OFFLINE:
        from . import calibrate  # deferred: offline code an inference process never loads

        return getattr(calibrate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(OFFLINE))
