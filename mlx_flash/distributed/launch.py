"""Joining a pipeline from a process mlx.launch started: load the model, plan every rank's layers
from every rank's memory, then rank 0 gets an Engine whose model calls go round the ranks and every
other rank serves its layers until rank 0 stops.

    mlx.launch --backend ring -n 2 -- python -m mlx_flash.chat --pipeline --prompt "..."     (one machine)
    mlx.launch --backend ring --hosts h1,h2 -- python -m mlx_flash.chat --pipeline --prompt "..."
    torchrun --nproc-per-node 2 -m mlx_flash.chat --pipeline --backend torch --prompt "..."   (gloo)

Every rank opens its own copy of the store (each machine converts or copies it to its own cache);
rank 0 refuses a rank whose copy differs from its own (the manifest's checksums). Not done yet: each
rank still loads every layer (the plan decides which layers it runs, not yet what it holds), the
REPL and the server (their contexts' KV lives on every rank) and the throughput mode.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..errors import ConfigError
from ..store.manifest import MANIFEST_NAME
from ..store.safetensors_io import tensor_layer
from .pipeline import Pipeline, serve
from .stages import plan_stages
from .transport import open_transport

MIB = 1 << 20


def _host_id() -> int:
    """A 31-bit number naming this machine (its host name's hash), to count the ranks on it."""
    import socket

    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:4], "big") >> 1


def _store_digest(store) -> np.ndarray:
    """Eight int32 words of the sha256 of the store's manifest (which seals every file's checksum)."""
    with open(store.file_path(MANIFEST_NAME), "rb") as fh:
        d = hashlib.sha256(fh.read()).digest()
    return np.frombuffer(d[:32], dtype=">u4").astype(np.int64) >> 1  # 31-bit words: int32 on the wire


def _layer_bytes(store) -> tuple[list[int], int]:
    """Each layer's bytes as stored (attention tensors and FFN bundles) and the rest (embeddings,
    head, norms), from the manifest."""
    m = store.manifest
    per = [m.ffn.layer_nbytes] * m.config["num_hidden_layers"]
    rest = 0
    for name, t in m.tensors.items():
        layer = tensor_layer(name)
        if layer is None:
            rest += t.nbytes
        else:
            per[layer] += t.nbytes
    return per, rest


def join(model, cfg, timeout: float = 30.0):
    """On rank 0: (its Engine, every rank's layer range). On the others: (None, their exit status),
    once rank 0 stops them or the pipeline breaks."""
    from ..api import load_config

    t = open_transport()
    if cfg.threads is None:  # ranks sharing a machine share its cores (a waiting rank polls its socket)
        from dataclasses import replace

        from ..backends import cpu_threads

        hosts = t.all_gather(np.array([_host_id()]))[:, 0]
        here = int((hosts == hosts[t.rank]).sum())
        cfg = replace(cfg, threads=max(1, cpu_threads() // here))
    engine = load_config(model, cfg)
    try:
        digests = t.all_gather(_store_digest(engine.store))
        rooms = t.all_gather(np.array([engine.memory_plan.get("weights_budget", 0) // MIB]))[:, 0] * MIB
        differ = [r for r in range(t.size) if not np.array_equal(digests[r], digests[0])]
        if differ:
            raise ConfigError(f"rank {differ[0]}'s copy of the store differs from rank 0's (manifest checksums): "
                              "give every rank the same store")
        per, rest = _layer_bytes(engine.store)
        stages = plan_stages(per, list(rooms), rank0_fixed=rest)
    except BaseException:
        engine.close()
        raise
    if t.rank == 0:
        engine.pipeline = Pipeline(engine, t, stages, timeout)
        return engine, stages
    with engine:
        status = serve(engine, t, stages)
    if status == 0:
        t.close()
    return None, status
