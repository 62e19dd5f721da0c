"""What an engine reads and where its weights may go, as the throughput mode's policy and a
pipeline's stages both need it: that its FFN runs whole layers, the flash read rate, whether dense
FFN layers stream whole, and the room the memory plan leaves for placing them. Facts about a loaded
engine; no batching here, so the distributed stages read them without reaching into the throughput
mode's runner."""

from __future__ import annotations

from ..config import FFNMode
from ..errors import ConfigError
from ..memory.weights_plan import copied_vectors
from ..store.disk_profile import default_profile
from ..store.sizes import resident_bytes


def check_whole_layers(engine) -> None:
    """The throughput mode runs whole FFN layers, in one process or across ranks: a sparse FFN (which
    follows one sequence's neurons) is refused in one line."""
    if engine.config.ffn is FFNMode.SPARSE:
        raise ConfigError(
            "throughput mode reads whole FFN layers: load the model with ffn='stream' (or 'resident' "
            "when it fits); a sparse FFN follows one sequence's neurons"
        )


def read_bps(engine) -> float:
    """Flash read throughput for whole-layer reads: the disk profile's best large-chunk rate."""
    prof = default_profile(engine.config.cache_dir)
    return max(max(row.values()) for row in prof["throughput"].values())


def streams_layers(engine) -> bool:
    """Whether the engine reads dense FFN layers whole (ffn stream): the placement the policy sets."""
    return engine.config.ffn is FFNMode.STREAM and not engine.store.manifest.ffn.n_experts


def weights_room(engine, default: int = 0) -> int:
    """The weights' share of the memory plan (`default` when there is none), less what the loaded
    weights already hold there: what placing FFN layers in memory may take."""
    lay = engine.store.manifest.ffn
    slots = engine.layer_slots
    attn = sum(slots.regions[i][2] for i in slots.regions) if slots is not None else 0
    held = (
        resident_bytes(engine.store)
        - attn
        + (slots.nbytes if slots is not None else 0)
        + (2 * lay.layer_nbytes if streams_layers(engine) else 0)
        + copied_vectors(engine.store)
    )
    return max(0, engine.memory_plan.get("weights_budget", default) - held)
