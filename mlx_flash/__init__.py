"""mlx_flash: run language models larger than memory by streaming weights from flash.

Public API:
  load                    a model -> Engine (generate / stream_generate; per-token stats in engine.last)
  memory_plan             how an engine's memory budget was split (bytes)
  expert_cache_stats      hits and misses of a MoE engine's expert cache, per layer
  convert                 GGUF / HF / mlx-community model -> store (tools/convert.py)
  moefy                   a dense Llama-family model -> a MoE-fied copy with trained routers (tools/moefy.py)
  profile_disk            random-read throughput by chunk size x threads, and latency (tools/profile_disk.py)
  default_profile         the disk profile load() uses (saved, or a quick probe run once)
  best_threads            reader threads a profile gives a chunk size
  coalesce_gap            the gap below which a profile's disk is cheaper to read through than to skip
  FlashError and subclasses: typed errors with one-line messages
"""

from .api import load
from .errors import (ConfigError, FlashError, ModelFileError, ModelNotFoundError, StoreError,
                     UnsupportedModelError)
from .moe.moefy import moefy
from .stats import expert_cache_stats, memory_plan
from .store.converter import convert
from .store.disk_profile import best_threads, coalesce_gap, default_profile, profile_disk

__version__ = "0.1.0"
__all__ = ["load", "memory_plan", "expert_cache_stats", "convert", "moefy", "profile_disk", "default_profile",
           "best_threads", "coalesce_gap", "FlashError", "ConfigError", "ModelFileError", "ModelNotFoundError",
           "StoreError", "UnsupportedModelError"]
