"""A pipeline stage's store: the layers one rank runs, cut out of a whole store as a store of its own
(layers renumbered from 0, the config's per-layer lists sliced to them), so the rank's loader and
memory planner see only what that rank holds or streams. Bytes are copied as stored (resident
tensors keep their order, so fused groups stay back to back; FFN layers keep their bundles). The
tensors outside the layers (embeddings, final norm, head) come along to the stage that runs them
(`outer`: rank 0, which embeds and samples); an inner stage drops them, names them in
source["stage"]["dropped"], and its weights getter gives None for them (a block reads only its own
layer's weights). The cut is written atomically and checksummed like any store."""

from __future__ import annotations

import dataclasses
import os

from ..durable import FolderFile, copy_new, write_new
from .atomic_dir import OutputError, atomic_dir, output_lock
from .manifest import ALIGNMENT, FFN_FILE, MANIFEST_NAME, RESIDENT_FILE, Manifest, sha256_file
from .safetensors_io import tensor_layer, write_safetensors
from .store import Store, is_store


def _renamed(name: str, first: int) -> str:
    """`name` of layer L as layer L - first (the segment after "layers")."""
    parts = name.split(".")
    at = parts.index("layers") + 1
    parts[at] = str(int(parts[at]) - first)
    return ".".join(parts)


def stage_config(config: dict, layers: range) -> dict:
    """The config of a model of `layers` alone: their count, and every per-layer list sliced."""
    n = config["num_hidden_layers"]
    out = {k: (v[layers.start : layers.stop] if isinstance(v, list) and len(v) == n else v) for k, v in config.items()}
    out["num_hidden_layers"] = len(layers)
    return out


def dropped_tensors(store: Store) -> frozenset:
    """The tensors an inner stage's cut left out (see the module docstring); empty for other stores."""
    stage = store.manifest.source.get("stage")
    return frozenset(stage.get("dropped", ())) if isinstance(stage, dict) else frozenset()


def cut_stage(store: Store, layers: range, out_dir: str, progress: bool = False, outer: bool = True) -> str:
    """The store of `layers` of `store` at out_dir (kept when a valid one is there already); outer:
    with the tensors outside the layers."""
    m = store.manifest
    n = m.config["num_hidden_layers"]
    if not (0 <= layers.start < layers.stop <= n):
        raise ValueError(f"layers {layers.start}-{layers.stop - 1} are not layers of this {n}-layer store")
    if m.ffn.expert_table:
        raise ValueError("stores mixing expert formats cannot be cut into stages yet")
    out_dir = os.path.abspath(out_dir)
    with output_lock(out_dir, progress):
        if is_store(out_dir):
            return out_dir
        kept = {}  # new name -> old name, in the old file's order
        for name, t in sorted(m.tensors.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
            layer = tensor_layer(name)
            if layer is None:
                if outer:
                    kept[name] = name
            elif layers.start <= layer < layers.stop:
                kept[_renamed(name, layers.start)] = name
        with atomic_dir(out_dir, progress, locked=True) as tmp:
            entries = _write_resident(store, kept, tmp)
            offsets = _write_ffn(store, layers, tmp)
            for name in sorted(os.listdir(store.path)):  # the tokenizer's files
                if name not in (RESIDENT_FILE, FFN_FILE, MANIFEST_NAME) and os.path.isfile(store.file_path(name)):
                    copy_new(store.file_path(name), os.path.join(tmp, name), OutputError)
            ffn = dataclasses.replace(
                m.ffn, layer_offsets=offsets, layer_quant=m.ffn.layer_quant[layers.start : layers.stop]
            )
            quant = {}
            for base, q in m.quant.items():
                layer = tensor_layer(base + ".weight")
                if layer is None:
                    if outer:
                        quant[base] = q
                elif layers.start <= layer < layers.stop:
                    quant[_renamed(base, layers.start)] = q
            files = {
                f: {"size": os.path.getsize(os.path.join(tmp, f)), "sha256": sha256_file(os.path.join(tmp, f))}
                for f in sorted(os.listdir(tmp))
            }
            dropped = sorted(name for name in m.tensors if tensor_layer(name) is None and not outer)
            source = {**m.source, "stage": {"layers": [layers.start, layers.stop], "of": n, "dropped": dropped}}
            manifest = Manifest(
                config=stage_config(m.config, layers), tensors=entries, quant=quant, ffn=ffn, files=files, source=source
            )
            write_new(os.path.join(tmp, MANIFEST_NAME), [manifest.to_json().encode()], OutputError)
    return out_dir


def _write_resident(store: Store, kept: dict, tmp: str) -> dict:
    """The kept resident tensors under their new names, each layer's in the old file's order."""
    m = store.manifest
    specs = {new: (m.tensors[old].shape, m.tensors[old].dtype) for new, old in kept.items()}
    runs: dict = {}
    for new in kept:  # (kept is in file order)
        runs.setdefault(tensor_layer(new), []).append(new)

    def produce(new):
        t = m.tensors[kept[new]]
        return store.read_bytes(t.file, t.offset, t.nbytes)

    return write_safetensors(
        os.path.join(tmp, RESIDENT_FILE), specs, produce, RESIDENT_FILE, adjacent=list(runs.values())
    )


def _write_ffn(store: Store, layers: range, tmp: str) -> list[int]:
    """The stage's FFN layers, each at an ALIGNMENT boundary as the converter places them."""
    lay = store.manifest.ffn
    offsets = []
    with FolderFile(os.path.join(tmp, FFN_FILE), OutputError) as fh:
        for i in layers:
            fh.pad_to(ALIGNMENT)
            offsets.append(fh.tell())
            fh.write(store.read_bytes(lay.file, lay.layer_offsets[i], lay.layer_nbytes))
        fh.pad_to(ALIGNMENT)
    return offsets
