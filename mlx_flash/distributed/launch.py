"""Joining a pipeline from a process mlx.launch started: load the model, plan every rank's layers
from every rank's memory, then rank 0 gets an Engine whose model calls go round the ranks and every
other rank serves its layers until rank 0 stops.

    mlx.launch --backend ring -n 2 -- python -m mlx_flash.chat --pipeline --prompt "..."     (one machine)
    mlx.launch --backend ring --hosts h1,h2 -- python -m mlx_flash.chat --pipeline --prompt "..."
    torchrun --nproc-per-node 2 -m mlx_flash.chat --pipeline --backend torch --prompt "..."   (gloo)

Every rank opens its own copy of the store (each machine converts or copies it to its own cache);
a rank whose copy differs from rank 0's is refused (the manifests' digests). Each rank then cuts the
store of its own layers (store/stage.py) and loads only that, so its memory plan holds or streams
only its layers. The throughput mode (`python -m mlx_flash.batch --pipeline`, engine.generate_batch)
sends micro-batches through the ranks (distributed/batch.py); the chat's REPL and the server
(`python -m mlx_flash.serve --pipeline`, distributed/serving.py) hold each conversation's KV on
every rank (distributed/conversations.py).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from ..errors import ConfigError
from ..offload.engine_room import streams_layers, weights_room
from ..store.manifest import MANIFEST_NAME
from ..store.safetensors_io import tensor_layer
from .pipeline import Pipeline
from .rank_serve import StageProfile, serve
from .stage_policy import WIRE_WORDS, StageSpeed, calibrate, stage_speed
from .stages import plan_stages
from .transport import open_transport
from ..api import load_config
from ..config import default_cache_dir
from ..default_model import resolve_store
from ..memory import resolve_limit
from ..store import open_store
from ..store.stage import cut_stage
from ..backends import cpu_threads

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


def load_for(args, cfg, batch: bool = False, verbose: bool = False):
    """The engine a command's flags ask for: (engine, None); on a pipeline's rank other than 0, once
    rank 0 stopped it, (None, its exit status). args: model, pipeline, pipeline_timeout; verbose (or
    batch): rank 0 prints the layer ranges."""

    if not args.pipeline:
        return load_config(args.model, cfg, batch=batch), None
    engine, status = join(args.model, cfg, args.pipeline_timeout, batch=batch, verbose=verbose or batch)
    if engine is None:
        return None, status
    if verbose or batch:
        held = engine.runner.held_ffn_layers
        print(
            "pipeline: "
            + ", ".join(
                f"rank {r} layers {s.start}-{s.stop - 1}" + (f" ({held[r]} FFN layers held)" if batch else "")
                for r, s in enumerate(status)
            ),
            file=sys.stderr,
        )
    return engine, None


def _place_ffn(engine) -> int:
    """Throughput mode on a rank whose FFN layers stream whole: hold as many of them as the weights'
    share of its plan leaves room for (each step of every micro-batch reads the others). Returns how
    many it holds."""
    if not streams_layers(engine):
        return 0
    n = min(engine.args.num_hidden_layers, weights_room(engine) // engine.store.manifest.ffn.layer_nbytes)
    engine.ffn.place(n)
    return n


def _hop_seconds(t, repeats: int = 5) -> float:
    """The median time of a one-number exchange between every rank: what a message between two
    ranks costs beyond its stage's work."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.all_gather(np.zeros(1, dtype=np.int64))
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def join(model, cfg, timeout: float = 30.0, progress: bool = True, batch: bool = False, verbose: bool = False):
    """On rank 0: (its Engine, every rank's layer range). On the others: (None, their exit status),
    once rank 0 stops them or the pipeline breaks. Before loading, the ranks compare their stores'
    digests and exchange their memory limits; each then cuts the store of its own layers (cached
    under `<cache>/stages/`) and loads that, planned under its own limit. verbose: the other ranks
    print where their time went when they stop."""

    t = open_transport()
    hosts = t.all_gather(np.array([_host_id()]))[:, 0]
    here = int((hosts == hosts[t.rank]).sum())  # ranks on this machine, sharing its cores and its drive
    if cfg.threads is None:  # (a waiting rank polls its socket)
        cfg = replace(cfg, threads=max(1, cpu_threads() // here))
    # the ranks batch sequences and size their KV by what each holds resident: KV tiers (models/
    # kv_tiers.py) are for one sequence alone, whose read buffers no other sequence shares meanwhile
    cfg = replace(cfg, kv_on_flash=False)
    limit = resolve_limit(cfg.memory_budget)
    store = open_store(
        resolve_store(model, cfg.cache_dir, cfg.store_precision(), progress),
        cfg.verify_checksums,
        progress,
        cfg.cache_dir,
    )
    digests = t.all_gather(_store_digest(store))
    limits = t.all_gather(np.array([limit.bytes // MIB]))[:, 0] * MIB
    differ = [r for r in range(t.size) if not np.array_equal(digests[r], digests[0])]
    if differ:
        raise ConfigError(
            f"rank {differ[0]}'s copy of the store differs from rank 0's (manifest checksums): "
            "give every rank the same store"
        )
    per, rest = _layer_bytes(store)
    # rank 0 alone holds the embeddings and head (it embeds and samples): off its room only
    stages = plan_stages(per, [int(x) for x in limits], rank0_fixed=rest)
    mine = stages[t.rank]
    digest = "".join(f"{int(w):08x}" for w in digests[0][:2])
    outer = t.rank == 0
    path = os.path.join(
        cfg.cache_dir or default_cache_dir(),
        "stages",
        f"{digest}-{mine.start}-{mine.stop}" + ("" if outer else "-inner"),
    )
    engine = load_config(cut_stage(store, mine, path, progress, outer), cfg, batch=batch)
    # the throughput mode's policy search takes every stage's measured time (distributed/stage_policy.py)
    timed = calibrate(engine, outer) if batch else None
    held = _place_ffn(engine) if batch else 0
    speed = stage_speed(engine, timed, held, here).to_wire() if batch else np.zeros(WIRE_WORDS, dtype=np.int64)
    # the KV each rank's plan holds for its layers, in tokens (a batch across ranks must fit the least),
    # the FFN layers each holds, and its stage's speed
    rows = t.all_gather(np.concatenate([[engine.kv_tokens or engine.model_context, held], speed]))
    kv_tokens, held_layers = rows[:, 0].tolist(), rows[:, 1].tolist()
    hop_s = _hop_seconds(t) if batch else 0.0
    if t.rank == 0:
        speeds = [StageSpeed.from_wire(r[2:]) for r in rows] if batch else None
        pipeline = Pipeline(engine, t, stages, timeout, kv_tokens, held_layers, speeds, hop_s, store.path)
        return engine.with_runner(pipeline), stages
    profile = StageProfile(t.rank)
    with engine:
        status = serve(engine, t, stages, profile)
    if verbose and profile.steps:  # where this stage's time went (rank 0 prints its own per token)
        print(profile.line(), file=sys.stderr)
    if status == 0:
        t.close()
    return None, status
