"""Expert-wise bit-widths (EdgeMoE §6): rewrite a MoE store's experts each at its own width.

From a store whose experts are float rows (f16 or f32), `write_expert_store` writes a new store with
the same resident weights and expert e of layer l at bits[l][e] in {2, 4, 8} or 16 (float16 rows).
Quantization is affine per group of `group_size` weights along each linear's input, in MLX's format
(packed uint32 codes, float16 scales and biases): gate and up rows along d_model, down in its own
orientation [D, Fe] along the expert's neurons (an expert is always read whole, so its down columns
need not be self-contained as the sparse FFN's are; these formats set `down_rows`). The grid is
each group's min..max. `mx.quantize` instead shifts the grid so that zero is exact, which re-rounds
weights that already sit on a 4-bit grid (a model converted from a 4-bit source): on the MoE-fied
SmolLM2 that alone cost +12% perplexity at 4 bits, where min..max loses nothing.
Each expert is one contiguous, 4 KiB-aligned run of bundle rows; the manifest's expert table says
where it lies and in which format. Quantization is the approximation here: tools/expert_bits.py
measures its cost.

`fake_quantized` gives an expert's weights as they come back from a width (quantized, then
dequantized to float), to measure importance without writing stores.
"""

from __future__ import annotations

import os

import numpy as np

from ..durable import FolderFile, copy_new, write_new
from ..errors import ConfigError
from ..quant_spec import QuantSpec
from ..store.atomic_dir import OutputError, atomic_dir
from ..store.bundles import pack_layer, plan_fields, unpack_rows
from ..store.manifest import ALIGNMENT, MANIFEST_NAME, RESIDENT_FILE, ExpertFormat, sha256_file

WIDTHS = (2, 4, 8, 16)
EXPERT_FILE = "ffn_experts.bin"
ROLES = ("gate", "up", "down")


def expert_rows(store, layer: int, expert: int) -> dict[str, np.ndarray]:
    """A float store's expert as float32 rows [Fe, D] per role (down as its stored transposed rows)."""
    lay = store.manifest.ffn
    if lay.expert_table or any(lay.quant.get(r) for r in ROLES):
        raise ConfigError(
            f"{store.path}: expert bit-widths start from a store with float experts "
            f"(this one is {lay.precision}); convert with precision f16"
        )
    with open(store.file_path(lay.file), "rb") as fh:
        fh.seek(lay.expert_offset(layer, expert))
        raw = np.frombuffer(fh.read(lay.expert_nbytes), np.uint8).reshape(lay.expert_rows, lay.bundle_bytes)
    arrays = unpack_rows(lay.fields, raw)
    if any(k.endswith(".bias") for k in arrays):
        raise ConfigError(f"{store.path}: experts with biases are not supported by expert bit-widths")
    return {r: arrays[f"{r}.weight"].astype(np.float32) for r in ROLES if f"{r}.weight" in arrays}


def affine_quantize(w: np.ndarray, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [n, k] -> (codes packed into uint32 [n, k*bits/32], lowest bits first as MLX packs them;
    scales, biases float16 [n, k/group_size]) with w ~ scale * code + bias over each group's min..max."""
    n, k = w.shape
    if k % group_size or 32 % bits:
        raise ConfigError(f"cannot quantize rows of {k} weights in groups of {group_size} at {bits} bits")
    g = w.astype(np.float32).reshape(n, k // group_size, group_size)
    lo, hi = g.min(2, keepdims=True), g.max(2, keepdims=True)
    scale = ((hi - lo) / (2**bits - 1)).astype(np.float16)
    bias = lo.astype(np.float16)
    s32 = np.where(scale == 0, 1, scale).astype(np.float32)
    codes = np.clip(np.rint((g - bias.astype(np.float32)) / s32), 0, 2**bits - 1).astype(np.uint32).reshape(n, k)
    per = 32 // bits
    words = (codes.reshape(n, k // per, per) << (np.arange(per, dtype=np.uint32) * bits)).sum(2, dtype=np.uint64)
    return words.astype(np.uint32), scale.reshape(n, -1), bias.reshape(n, -1)


def affine_dequantize(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int):
    per = 32 // bits
    codes = (words[..., None] >> (np.arange(per, dtype=np.uint32) * bits)) & np.uint32(2**bits - 1)
    n = words.shape[0]
    codes = codes.reshape(n, -1, group_size).astype(np.float32)
    return (codes * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]).reshape(n, -1)


def quantized_parts(rows: dict[str, np.ndarray], bits: int, group_size: int) -> list[tuple[str, np.ndarray, str]]:
    """Bundle parts of one expert [Fe rows each] at `bits` (16: float16 rows). Quantized down is the
    [D, Fe] matrix quantized along Fe, its arrays cut into Fe equal pieces, one per bundle row."""
    parts = []
    for role, w in rows.items():
        if bits == 16:
            parts.append((f"{role}.weight", w.astype(np.float16), "float16"))
            continue
        n = w.shape[0]
        q = affine_quantize(np.ascontiguousarray(w.T) if role == "down" else w, bits, group_size)
        for s, a in zip(("weight", "scales", "biases"), q):
            parts.append((f"{role}.{s}", a.reshape(n, -1), str(a.dtype)))
    return parts


def fake_quantized(rows: dict[str, np.ndarray], bits: int, group_size: int = 32) -> dict[str, np.ndarray]:
    """The rows (down as stored: [Fe, D]) as a `bits`-wide expert computes with them, float32."""
    if bits == 16:
        return {r: w.astype(np.float16).astype(np.float32) for r, w in rows.items()}
    out = {}
    for role, w in rows.items():
        m = np.ascontiguousarray(w.T) if role == "down" else w
        d = affine_dequantize(*affine_quantize(m, bits, group_size), bits, group_size)
        out[role] = np.ascontiguousarray(d.T) if role == "down" else d
    return out


def write_expert_store(store, out_dir: str, bits: list[list[int]], group_size: int = 32, progress: bool = True) -> str:
    """A copy of `store` with expert (l, e) at bits[l][e]; returns out_dir. Atomic like convert()."""
    from dataclasses import replace

    from tqdm import tqdm

    lay = store.manifest.ffn
    L, E = len(lay.layer_offsets), lay.n_experts
    if not E:
        raise ConfigError(f"{store.path}: not a mixture-of-experts store")
    if len(bits) != L or any(len(r) != E for r in bits) or any(b not in WIDTHS for r in bits for b in r):
        raise ConfigError(f"bit-widths must be {L} layers x {E} experts, each one of {WIDTHS}")
    if os.path.abspath(out_dir) == os.path.abspath(store.path):
        raise ConfigError(f"{out_dir}: the new store cannot replace the store it is made from")
    with atomic_dir(out_dir) as tmp:
        formats: dict[int, ExpertFormat] = {}
        table = []
        with FolderFile(os.path.join(tmp, EXPERT_FILE), OutputError) as fh:  # (atomic_dir's folder)
            for layer in tqdm(range(L), desc="writing experts", unit="layer", disable=not progress):
                row = []
                for e in range(E):
                    b = bits[layer][e]
                    parts = quantized_parts(expert_rows(store, layer, e), b, group_size)
                    if b not in formats:
                        fields, bundle_bytes = plan_fields(parts)
                        q = None if b == 16 else QuantSpec(bits=b, group_size=group_size)
                        formats[b] = ExpertFormat(
                            precision="f16" if b == 16 else f"q{b}",
                            bundle_bytes=bundle_bytes,
                            fields=fields,
                            quant={r: q for r in ROLES if f"{r}.weight" in {p[0] for p in parts}},
                            down_rows=b != 16,
                        )
                    f = formats[b]
                    fh.pad_to(ALIGNMENT)
                    row.append([b, fh.tell()])
                    fh.write(pack_layer(f.fields, f.bundle_bytes, {p[0]: p[1] for p in parts}))
                table.append(row)
            fh.pad_to(ALIGNMENT)
        order = sorted(formats)
        index = {b: i for i, b in enumerate(order)}
        table = [[[index[b], off] for b, off in row] for row in table]
        widest = formats[max(formats, key=lambda b: formats[b].bundle_bytes)]
        starts = [row[0][1] for row in table]
        ffn = replace(
            lay,
            file=EXPERT_FILE,
            bundle_bytes=widest.bundle_bytes,
            fields=widest.fields,
            quant=widest.quant,
            precision="mixed" if len(formats) > 1 else widest.precision,
            down_rows=widest.down_rows,
            layer_offsets=starts,
            expert_formats=[formats[b] for b in order],
            expert_table=table,
        )
        for name in os.listdir(store.path):
            if name not in (MANIFEST_NAME, lay.file) and os.path.isfile(os.path.join(store.path, name)):
                copy_new(os.path.join(store.path, name), os.path.join(tmp, name), OutputError)
        files = {
            RESIDENT_FILE: dict(store.manifest.files[RESIDENT_FILE]),
            EXPERT_FILE: {
                "size": os.path.getsize(os.path.join(tmp, EXPERT_FILE)),
                "sha256": sha256_file(os.path.join(tmp, EXPERT_FILE)),
            },
        }
        source = dict(store.manifest.source, expert_bits_from=os.path.basename(store.path))
        manifest = replace(store.manifest, ffn=ffn, files=files, source=source)
        write_new(os.path.join(tmp, MANIFEST_NAME), [manifest.to_json().encode()], OutputError)
    return out_dir
