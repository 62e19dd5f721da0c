"""One memory limit for the whole process (`memory_budget`): what the process may use
(available.py), the limit a user's value means (limit.py), how the planner splits it between the
runtime, the KV cache, work buffers and weights (process_plan.py), what the weights' share holds
(weights_plan.py), and a model's whole plan at load (load_plan.py). Sizes come from the store
(store/sizes.py); the sparse and expert planners plan their own share under this one."""

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
