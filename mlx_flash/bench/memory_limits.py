"""What `python -m mlx_flash.bench memory` runs and how it sums one limit's runs up: the engines and modes (ours
per backend, sparse shares, llama.cpp mmap and no-mmap), the bytes a token must read at a limit,
and the medians of a cell (one engine at one limit)."""

from __future__ import annotations

from .decode_pairs import peer_built
import os
import statistics
from dataclasses import dataclass

from ..store import open_store
from ..store.sizes import model_bytes


@dataclass(frozen=True)
class Engine:
    name: str  # "mlx_flash" or "llama.cpp"
    mode: str  # backend, or mmap / no-mmap
    model: str  # what it loads: a store or a GGUF
    weights: int  # bytes of weights it reads
    active: float | None = None  # ours, sparse: the statistical model's share of FFN read units per token
    ffn: int = 0  # bytes of the FFN layers (the part a sparse row or a MoE token uses a share of)
    routed: float = 1.0  # the share of the FFN a token routes to: experts per token / experts (1: dense)

    @property
    def label(self) -> str:
        if self.active is None:
            return f"{self.name} {self.mode}"
        return f"{self.name} {self.mode} sparse {self.active:.0%}"

    @property
    def used_per_token(self) -> int:
        """Bytes of weights one token uses: all of them, or (sparse) the non-FFN ones and the share."""
        share = self.routed if self.active is None else self.active
        return int(self.weights - (1 - share) * self.ffn)

    @property
    def run_mode(self) -> str:
        """The mode argument of memory_child.py: the backend, and the sparse share after a colon."""
        return self.mode if self.active is None else f"{self.mode}:{self.active}"


def store_sizes(store: str) -> tuple[int, int, float]:
    """(bytes of the store's weights as stored: what our engine holds of them when all are resident;
    bytes of its FFN layers; the share of them a token routes to: 1 for a dense model)."""
    s = open_store(store, False, False)
    m = s.manifest
    routed = m.config["num_experts_per_tok"] / m.ffn.n_experts if m.ffn.n_experts else 1.0
    return model_bytes(s), m.ffn.layer_nbytes * len(m.ffn.layer_offsets), routed


def engines_for(
    gguf: str | None, store: str, backends: list[str], peer: str, sparse: tuple[float, ...] = ()
) -> tuple[list[Engine], str]:
    """The engine/modes to run, peer and ours alternating, and a note on the peer ("" when it runs)."""
    weights, ffn, routed = store_sizes(store)
    ours = [Engine("mlx_flash", b, store, weights, None, ffn, routed) for b in backends]
    ours += [Engine("mlx_flash", b, store, weights, s, ffn) for b in backends for s in sparse]
    note = ""
    if peer == "none":
        peers = []
    elif gguf is None:
        peers, note = [], "llama.cpp skipped: the model is not a GGUF file"
    elif not peer_built():
        peers, note = [], "llama.cpp skipped: llama-cpp-python is not installed (make peers installs it)"
    else:
        # the GGUF's experts are the store's, block for block: the same routed share
        peers = [Engine("llama.cpp", m, gguf, os.path.getsize(gguf), None, ffn, routed) for m in ("mmap", "no-mmap")]
    order = []
    for i in range(max(len(peers), len(ours))):
        order += peers[i : i + 1] + ours[i : i + 1]
    return order, note


def summarize(e: Engine, label: str, limit: int, floor: int, bandwidth: float, runs: list[dict]) -> dict:
    ok = [r for r in runs if r["outcome"] == "ok"]
    bad = [r["outcome"] for r in runs if r["outcome"] != "ok"]
    outcome = "ok" if not bad else (bad[0] if len(bad) == len(runs) else f"{bad[0]} {len(bad)}/{len(runs)}")

    def med(key):
        vals = [r[key] for r in ok if key in r]
        return statistics.median(vals) if vals else None

    must_read = max(0, e.used_per_token - (limit - floor))
    per_token, rate = med("decode_read_bytes_per_token"), med("decode_tps")
    teacher = any(r.get("teacher_forced") for r in ok)
    return {
        "engine": e.name,
        "mode": e.label.split(" ", 1)[1],
        "limit_label": label,
        "limit": limit,
        "floor": floor,
        "weights": e.weights,
        "outcome": outcome,
        "prefill_tps": med("prefill_tps"),
        "ttft_s": med("first_token_s"),
        "decode_tps": med("decode_tps"),
        "teacher_forced": teacher,
        "expert_hit_rate": med("expert_hit_rate"),
        "replay_tps": med("replay_tps"),
        "peak_cgroup": max(r["peak_cgroup"] for r in runs),
        "vmhwm": med("vmhwm"),
        "major_faults": statistics.median(r["major_faults_all"] for r in runs),
        "read_bytes": statistics.median(r["read_bytes_all"] for r in runs),
        "refault_bytes": statistics.median(r["refault_bytes"] for r in runs),
        "decode_read_per_token": per_token,
        "decode_read_rate": per_token * rate if rate else None,
        "oom_kills": sum(r["oom_kills"] for r in runs),
        "must_read_per_token": must_read,
        "disk_bound_tps": bandwidth / must_read if must_read else None,
        "others_cpu": max(r["others_cpu"] for r in runs),
        "refused": next((r["refused"] for r in runs if "refused" in r), None),
        "plan_line": next((r["plan_line"] for r in runs if r["plan_line"]), ""),
        "runs": runs,
    }
