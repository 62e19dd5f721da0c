"""LLMS: the engine as a local service holding many chat contexts in chunked, swappable KV.

service.py (contexts and calls), call_steps.py (the steps of a call: prepare, open_call,
close_call), lookup.py (a context by id and owner, by common prefix), chunk_pool.py (KV
chunk slots), chunked_kv.py (the chunked member of the KV-cache protocol), lifecycle.py (LCTRU
eviction order), restore.py (read and recompute swapped chunks at once), swap_files.py (the service
directory on flash), and the OpenAI-compatible HTTP server (server.py, run by
`python -m mlx_flash.serve`).
"""

from .service import CallReport, Service, ServiceStats

__all__ = ["Service", "CallReport", "ServiceStats"]
