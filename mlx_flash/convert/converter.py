"""Convert a GGUF file / HF directory / mlx-community directory into a store directory.

Output: manifest.json, resident.safetensors (everything but the FFN), ffn_bundles.bin (row-column
bundles, layer regions 4 KiB-aligned) and the tokenizer files. Conversion is atomic: everything is
written into a hidden sibling directory that is renamed into place only after the manifest (written
last) is complete, so a crash or Ctrl-C never leaves a directory that opens as a store.

FFN precision (`precision`):
  source         keep the source's bytes exactly (lossless). A source that quantizes the down
                 projection along d_ff in groups of g (GGUF, mlx-community) gets bundles of g
                 neurons: their gate and up rows and the down matrix's [D, g] slice as stored
  source-neuron  gate/up as the source has them, the down projection re-quantized along d_model at
                 `down_bits` (default 8) so every neuron is a bundle of its own (the finer read
                 unit, at a measured quality cost: docs/earlier-results/flash.md, "Sparse read unit")
  f16            dequantize gate/up/down to float16 (lossless for 4/8-bit sources up to fp16 rounding)
  q4, q8         affine-quantize gate/up/down rows to 4/8 bits (group 32 unless group_size says otherwise)
"""

from __future__ import annotations

import os

import numpy as np

from ..durable import FolderFile, write_new
from ..errors import ConfigError, ModelFileError
from ..models import model_module
from ..progress import byte_bar, step
from ..kernels.gguf_blocks_ref import dequantize as dequantize_blocks
from ..quant_spec import BLOCKS, QuantSpec
from ..choices import PRECISIONS
from ..store.bundles import pack_layer, plan_fields
from ..store.manifest import ALIGNMENT, FFN_FILE, MANIFEST_NAME, RESIDENT_FILE, FFNLayout, Manifest, sha256_file
from ..store.atomic_dir import OutputError, atomic_dir, output_lock
from ..store.safetensors_io import write_safetensors
from ..store.store import is_store
from .source_model import SourceModel
from .sources import read_source

# Bumped whenever the converter's output for the same input and options changes (cache keys use it;
# the manifest's `source` records it from 8 on, so `python -m mlx_flash.stores prune` finds older stores).
CONVERTER_VERSION = 8


def to_storage(a) -> tuple[np.ndarray, str]:
    """mx.array -> (numpy array, storage dtype name); bfloat16 travels as raw uint16 words."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)), "bfloat16"
    n = np.array(a)
    return n, str(n.dtype)


def _release() -> None:
    """Return the memory of the arrays just dropped to the system (MLX keeps freed buffers in a
    cache), so conversion holds one layer at a time, not its high-water mark."""
    import mlx.core as mx

    mx.clear_cache()


def convert(
    source: str,
    out_dir: str,
    precision: str = "source",
    group_size: int = 32,
    down_bits: int = 8,
    force: bool = False,
    progress: bool = True,
    reuse: bool = False,
) -> str:
    """Convert `source` (a GGUF file, or an HF / mlx-community model directory) into a store at
    `out_dir` (must not exist unless `force`); returns out_dir, which load() takes as its model.
    `precision` of the FFN bundles: "source" (the source's bytes, lossless), "source-neuron" (down
    re-quantized along d_model at `down_bits`), "f16", "q4" or "q8" (see the module's docstring). The
    store is written atomically, one converter at a time (store/atomic_dir.py); `reuse`: a valid
    store already at out_dir (another converter's, finished while this one waited) is kept
    (`python -m mlx_flash.convert`)."""
    source, out_dir = os.fspath(source), os.fspath(out_dir)  # (paths as str or os.PathLike)
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is unknown (choose one of: {', '.join(PRECISIONS)})")
    if down_bits not in (2, 3, 4, 6, 8):
        raise ConfigError(f"down_bits must be one of 2, 3, 4, 6, 8 (got {down_bits})")
    out_dir = os.path.abspath(out_dir)
    with output_lock(out_dir, progress):  # a second converter into out_dir waits here, then sees its result
        if os.path.exists(out_dir):
            if reuse and is_store(out_dir):
                return out_dir
            if not force:
                raise ConfigError(f"{out_dir}: already exists (pass --force to replace it)")
        with step(f"reading {os.path.basename(source.rstrip('/'))}", progress):
            src = read_source(source)
        with atomic_dir(out_dir, progress, locked=True) as tmp:
            manifest = _write_store(src, tmp, precision, group_size, down_bits, progress)
            # last, inside the folder: a store is a store once its manifest is there (atomic_dir
            # then fsyncs every file and renames the folder into place)
            write_new(os.path.join(tmp, MANIFEST_NAME), [manifest.to_json().encode()], OutputError)
    return out_dir


def _write_store(
    src: SourceModel, tmp: str, precision: str, group_size: int, down_bits: int, progress: bool
) -> Manifest:
    from tqdm import tqdm

    cfg = src.config
    mod = model_module(cfg["model_type"], "config")
    # The tokenizer first: a vocabulary that cannot be built here (a sentencepiece one without
    # transformers) is refused before minutes of tensors are written.
    with step("building the tokenizer", progress):
        src.save_tokenizer(tmp)
    n_layers = cfg["num_hidden_layers"]
    ffn_tensors = set()
    for layer in range(n_layers):
        for group in _ffn_groups(mod, cfg, layer):
            for role, base in group.items():
                names = [base + s for s in (".weight", ".scales", ".biases")]
                if base + ".weight" not in src.tensors:
                    raise ModelFileError(f"{src.name}: tensor {base}.weight is missing")
                if role != "down":
                    names.append(base + ".bias")  # one bias value per neuron travels in its bundle
                ffn_tensors.update(n for n in names if n in src.tensors)
    resident = {n: src.tensors.spec(n) for n in src.tensors.names() if n not in ffn_tensors}

    def produce(name):
        data = to_storage(src.tensors.take(name))[0]
        _release()
        return data

    with step("writing the resident tensors (attention, norms, embeddings)", progress):
        tensors = write_safetensors(
            os.path.join(tmp, RESIDENT_FILE), resident, produce, RESIDENT_FILE, adjacent=_fused_runs(mod, cfg)
        )
    quant = {b: q for b, q in src.quant.items() if b + ".weight" in resident}

    layer_offsets, fields, bundle_bytes, ffn_quant, block, layer_quant = [], None, 0, None, 1, []
    d_model = cfg["hidden_size"]
    widths = _block_widths(src, mod, cfg, precision)
    with FolderFile(os.path.join(tmp, FFN_FILE), OutputError) as fh:
        for layer in tqdm(range(n_layers), desc="bundling FFN layers", disable=not progress, unit="layer"):
            parts, lq, blk = _layer_parts(src, _ffn_groups(mod, cfg, layer), precision, group_size, down_bits)
            parts = [_padded(p, widths) for p in parts]
            layer_quant.append(lq)
            if fields is None:
                fields, bundle_bytes = plan_fields(parts)
                ffn_quant, block = lq, blk
            elif [(p[0], list(p[1].shape[1:]), p[2]) for p in parts] != [(f.name, f.shape, f.dtype) for f in fields]:
                raise ModelFileError(f"{src.name}: FFN of layer {layer} differs in shape or type from layer 0")
            packed = pack_layer(fields, bundle_bytes, {p[0]: p[1] for p in parts})
            fh.pad_to(ALIGNMENT)
            layer_offsets.append(fh.tell())
            fh.write(memoryview(packed.reshape(-1)))
            del parts, packed
            _release()
        fh.pad_to(ALIGNMENT)
    n_neurons = cfg["intermediate_size"]
    ffn = FFNLayout(
        file=FFN_FILE,
        gated="gate" in mod.ffn_parts(cfg, 0),
        n_neurons=n_neurons,
        d_model=d_model,
        bundle_bytes=bundle_bytes,
        fields=fields,
        quant=ffn_quant,
        layer_offsets=layer_offsets,
        precision=precision,
        n_experts=int(cfg.get("num_experts", 0)),
        block=block,
        layer_quant=layer_quant if any(q != ffn_quant for q in layer_quant) else [],
    )
    files = {}
    names = sorted(os.listdir(tmp))  # the tensors' files and the tokenizer's: every byte the engine reads
    paths = [os.path.join(tmp, name) for name in names]
    with byte_bar(sum(map(os.path.getsize, paths)), "checksums", progress) as bar:
        for name, p in zip(names, paths):
            files[name] = {"size": os.path.getsize(p), "sha256": sha256_file(p, bar)}
    source = {**src.description, "converter_version": CONVERTER_VERSION}  # (cli/models.py prune reads it)
    return Manifest(config=cfg, tensors=tensors, quant=quant, ffn=ffn, files=files, source=source)


def _block_widths(src: SourceModel, mod, cfg: dict, precision: str) -> dict[str, int]:
    """Field name -> bytes per row of that bundle field, for the FFN matrices kept in GGUF block types
    whose type differs between layers (a Q4_K_M file mixes Q4_K and Q6_K down projections): the
    widest type's, so every layer's bundles share one layout (a narrower layer's rows are padded with
    zeros and decoded with its own type, FFNLayout.layer_quant). Empty when no type varies."""
    if precision != "source":
        return {}
    seen: dict[str, set] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for group in _ffn_groups(mod, cfg, layer):  # the dense FFN, or each expert
            for role, base in group.items():
                spec = src.quant.get(base)
                if spec is not None and spec.is_block:
                    blk = BLOCKS[spec.kind]
                    width = blk.nbytes if role == "down" else blk.row_bytes(cfg["hidden_size"])
                    seen.setdefault(f"{role}.weight", set()).add(width)
    return {name: max(w) for name, w in seen.items() if len(w) > 1}


def _padded(part: tuple, widths: dict[str, int]) -> tuple:
    """A bundle part whose rows are padded with zeros to its field's width (see _block_widths)."""
    name, arr, dtype = part
    width = widths.get(name)
    if width is None or arr.shape[-1] == width:
        return part
    out = np.zeros((*arr.shape[:-1], width), dtype=arr.dtype)
    out[..., : arr.shape[-1]] = arr
    return name, out, dtype


def _fused_runs(mod, cfg: dict) -> list[list[str]]:
    """Tensor names to store back to back: for each group of linears the model's build() fuses into
    one matmul (q, k, v), each part (codes, scales, biases, bias) of the members in member order,
    so the fused weight is a view of the bytes read (weights.join_rows), not a copy. build() itself
    says which groups it fuses: it runs here with a getter that records the lists it is asked for."""
    groups = []

    def record(name, optional: bool = False):
        if isinstance(name, (list, tuple)):
            groups.append(list(name))

    mod.build(None, mod.ModelArgs.from_dict(cfg), record)
    return [[f"{m}.{part}" for m in g] for g in groups for part in ("weight", "scales", "biases", "bias")]


def _ffn_groups(mod, cfg: dict, layer: int) -> list[dict]:
    """The linears of one layer's FFN: one group for a dense FFN, one per expert (in expert order) for
    MoE, whose neurons follow each other so expert e is one contiguous run of bundle rows."""
    return mod.expert_parts(cfg, layer) if cfg.get("num_experts") else [mod.ffn_parts(cfg, layer)]


def _layer_parts(src: SourceModel, groups: list[dict], precision: str, group_size: int, down_bits: int):
    """Bundles of one layer's FFN (its groups' neurons one after another), in bundle order:
    ([(field, array [bundles, ...], dtype)], quant, neurons per bundle)."""
    per_group = [_group_parts(src, names, precision, group_size, down_bits) for names in groups]
    if len(per_group) == 1:
        return per_group[0]
    parts = [
        (name, np.concatenate([g[0][k][1] for g in per_group]), dt) for k, (name, _, dt) in enumerate(per_group[0][0])
    ]
    return parts, per_group[0][1], per_group[0][2]


def _group_parts(src: SourceModel, names: dict, precision: str, group_size: int, down_bits: int):
    """One FFN's bundle parts, quantization per role and neurons per bundle (see the docstring)."""
    down_spec = src.quant.get(names["down"])
    if precision == "source" and down_spec is not None:
        return _source_blocks(src, names, down_spec.group_size)
    import mlx.core as mx

    parts, quant = [], {}
    for role in ("gate", "up", "down"):
        if role not in names:
            continue
        base = names[role]
        spec = src.quant.get(base)
        stored = {
            s: src.tensors.take(f"{base}.{s}") for s in ("weight", "scales", "biases") if f"{base}.{s}" in src.tensors
        }
        if spec is not None and spec.is_block:
            dense = mx.array(dequantize_blocks(np.array(stored["weight"]), spec.kind))
        elif spec is not None:
            dense = mx.dequantize(
                stored["weight"], stored["scales"], stored["biases"], group_size=spec.group_size, bits=spec.bits
            )
        else:
            dense = stored["weight"]
        if role == "down":
            dense = dense.T  # [D, F] -> [F, D]: column i of down becomes row i
        target = _target_quant(precision, spec, group_size)
        if role == "down" and precision == "source-neuron" and spec is not None:
            target = QuantSpec(bits=down_bits, group_size=group_size if spec.is_block else spec.group_size)
        if target is None:  # float rows
            dt = mx.float16 if precision == "f16" else dense.dtype
            arr, name = to_storage(mx.contiguous(dense.astype(dt)))
            parts.append((f"{role}.weight", arr, name))
        elif spec == target and role != "down":  # keep the source's packed rows untouched
            for s in ("weight", "scales", "biases"):
                arr, name = to_storage(stored[s])
                parts.append((f"{role}.{s}", arr, name))
        else:
            # block types carry their scales inside the blocks: the affine copy's are float16
            sdt = stored["scales"].dtype if spec is not None and not spec.is_block else mx.float16
            if not mx.issubdtype(sdt, mx.floating):
                sdt = mx.float16
            qw, qs, qb = mx.quantize(mx.contiguous(dense.astype(sdt)), group_size=target.group_size, bits=target.bits)
            for s, a in (("weight", qw), ("scales", qs), ("biases", qb)):
                arr, name = to_storage(a)
                parts.append((f"{role}.{s}", arr, name))
        quant[role] = target
        if base + ".bias" in src.tensors and role != "down":
            arr, name = to_storage(src.tensors.take(base + ".bias"))
            parts.append((f"{role}.bias", arr.reshape(-1, 1), name))
    return parts, quant, 1


def _source_blocks(src: SourceModel, names: dict, block: int):
    """Bundles of `block` neurons holding the source's bytes unchanged: per block, its gate and up
    rows ([block, ...] each, as stored) and the down matrix's columns of the block, which are one
    quantization group of every d_model row: codes [D, block*bits/32], scales and biases [D, 1]."""
    parts, quant = [], {}
    for role in ("gate", "up", "down"):
        if role not in names:
            continue
        base = names[role]
        quant[role] = src.quant.get(base)
        stored = [s for s in ("weight", "scales", "biases") if f"{base}.{s}" in src.tensors]
        for s in stored:
            arr, name = to_storage(src.tensors.take(f"{base}.{s}"))
            if role == "down":  # [D, F*per] -> [F/block, D, per-block]
                d = arr.shape[0]
                arr = np.ascontiguousarray(
                    arr.reshape(d, -1, arr.shape[1] * block // _n_neurons(src, names)).transpose(1, 0, 2)
                )
            else:  # [F, ...] -> [F/block, block, ...]
                arr = arr.reshape(-1, block, *arr.shape[1:])
            parts.append((f"{role}.{s}", arr, name))
        if base + ".bias" in src.tensors and role != "down":
            arr, name = to_storage(src.tensors.take(base + ".bias"))
            parts.append((f"{role}.bias", arr.reshape(-1, block), name))
    return parts, quant, block


def _n_neurons(src: SourceModel, names: dict) -> int:
    """d_ff of this FFN: the rows of its up projection (stored rows are neurons)."""
    return int(src.tensors.spec(names["up"] + ".weight")[0][0])


def _target_quant(precision: str, spec: QuantSpec | None, group_size: int) -> QuantSpec | None:
    if precision == "f16":
        return None
    if precision in ("source", "source-neuron"):
        return spec
    return QuantSpec(bits=4 if precision == "q4" else 8, group_size=group_size)
