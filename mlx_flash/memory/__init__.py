"""One memory limit for the whole process (`memory_budget`): what the process may use
(available.py), the limit a user's value means (limit.py), and how the planner splits it between
the runtime, the KV cache, work buffers and weights (process_plan.py)."""

from .available import Available, available_memory, peak_rss, process_rss
from .limit import MemoryLimit, resolve_limit
from .process_plan import ModelShape, ProcessPlan, kv_bytes_per_token, plan_process, work_bytes

__all__ = [
    "Available",
    "available_memory",
    "peak_rss",
    "process_rss",
    "MemoryLimit",
    "resolve_limit",
    "ModelShape",
    "ProcessPlan",
    "kv_bytes_per_token",
    "plan_process",
    "work_bytes",
]
