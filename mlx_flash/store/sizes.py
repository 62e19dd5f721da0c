"""What a store holds, in bytes as stored at its own precision (the manifest's sizes): the resident
tensors, one FFN layer, one read unit (a bundle row), one expert, the whole model. The memory planner
(memory/) and the FFN planners (sparse/, moe/) ask these; a backend's held sizes (converted copies)
are measured on the backend and passed in where they differ."""

from __future__ import annotations


def resident_bytes(store) -> int:
    """The resident tensors (embeddings, attention, norms, head) as stored."""
    return sum(t.nbytes for t in store.manifest.tensors.values())


def vector_bytes(store) -> int:
    """The resident vectors (norms, biases: one dimension) as stored."""
    return sum(t.nbytes for t in store.manifest.tensors.values() if len(t.shape) == 1)


def ffn_layer_bytes(store) -> int:
    """One FFN layer's bundles as stored (every expert of a MoE layer)."""
    return store.manifest.ffn.layer_nbytes


def ffn_layers(store) -> int:
    """FFN layers in the store."""
    return len(store.manifest.ffn.layer_offsets)


def read_unit_bytes(store) -> int:
    """One bundle row as stored: the unit a sparse FFN reads and caches."""
    return store.manifest.ffn.bundle_bytes


def expert_bytes(store) -> int:
    """One expert as stored (of the widest format in a mixed store: what a cache slot holds); 0 for a
    dense store."""
    lay = store.manifest.ffn
    return lay.expert_nbytes if lay.n_experts else 0


def model_bytes(store, resident: int | None = None, ffn_layer: int | None = None) -> int:
    """Bytes of the fully resident model: its resident tensors and every FFN layer, as a backend
    holds them when given (`resident`, `ffn_layer` = one converted layer), else as stored."""
    res = resident_bytes(store) if resident is None else resident
    return res + (ffn_layer_bytes(store) if ffn_layer is None else ffn_layer) * ffn_layers(store)
