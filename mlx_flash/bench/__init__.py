"""Measuring harnesses the benchmark tools (tools/bench_*.py) and tests share: one configuration of the
throughput benchmark (throughput.py), a child run inside a memory cgroup (cgroup.py), memory_budget
against the peak RSS it allows (budget_kept.py), the LLMS trace benchmark (service_trace.py) and its
switching trace on long contexts (switching_trace.py), the server's load client (load_client.py),
the sparse FFN kernels' check and timing (sparse_kernels.py). Above the engine, imported by tools
and tests only, never by the runtime packages they measure (tests/test_layering.py)."""
