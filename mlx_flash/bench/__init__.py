"""The benchmarks, `python -m mlx_flash.bench NAME [args]` (one module each in commands/; __main__.py
lists them), and the measuring harnesses they and the tests share: one configuration of the
throughput benchmark (throughput.py), a child run inside a memory cgroup (cgroup.py), memory_budget
against the peak RSS it allows (budget_kept.py), the LLMS trace benchmark (service_trace.py) and its
switching trace on long contexts (switching_trace.py), the server's load client (load_client.py),
the sparse FFN kernels' check and timing (sparse_kernels.py); the measured child of the memory
benchmarks (memory_child.py, run by its path so that it imports nothing of the package). Above the
engine, imported by its commands, tools and tests only, never by the runtime packages they measure
(tests/test_layering.py)."""
