"""Synthetic GGUF checkpoints of real large shapes (Llama-2-7B, Qwen3-30B-A3B): random weights in a
real GGUF block quantization (Q4_1, Q4_0, Q8_0), the default model's tokenizer, loadable by
llama.cpp and by our converter. Everything measured on them is synthetic: the bytes, the layout and
the read pattern are real, the weights are not (the text they generate is noise).

A dense shape is llama.cpp's `llama` architecture; the Qwen3-MoE shape is its `qwen3moe`: per layer a
float32 router (ffn_gate_inp) and the experts as three 3-D tensors (ffn_{gate,up,down}_exps, experts
outermost, so one expert is a contiguous byte range), per-head q/k norms and heads wider than
d_model / heads (attention.key_length). Mixtral-style MoE shapes are refused (the converter reads no
MoE GGUF but qwen3moe).

Random blocks keep every weight small, finite and centred (|w| <= 0.025, a standard deviation of
about 0.011, near 1/sqrt(4096)), so the hidden state stays in range over 32 layers and the logits
stay finite (Llama-2-7B shape: logits of standard deviation ~0.75 in llama.cpp and here).

A MoE shape must route like a trained model, or a benchmark of expert caching measures nothing: over
a text a trained router spreads its choices (most experts of a layer used, consecutive tokens
sharing few). Random attention does not: each layer's output is a softmax average of values over
the context, alike for every token of a text, and with norms of ones it soon outweighs the tokens'
own embeddings, so deeper layers route most tokens to the same few experts (measured on the
Qwen3-30B-A3B shape's 48 layers with experts of 32 neurons, over 32 tokens of Wikipedia: from layer
1 on, 13% or fewer of a layer's experts used, consecutive tokens sharing 81-100% of theirs). So a
MoE shape's attn_norm is ATTN_GAIN instead of 1: attention adds little, each token's hidden state
stays its embedding plus what the random experts make of it, and each layer's router (random
float32 of standard deviation 1/sqrt(d_model): logits of about 1) sends each token of a text to its
own experts at every depth (80% or more of each layer's experts used, overlap under 0.11, no expert
in more than 10 of 32 tokens). What it lacks is a trained model's structure across layers and context: routing here
follows the token through one random map per layer (calibrate.routes.routing_spread measures the
spread; tests/calibrate/test_synthetic_gguf.py holds a few-layer file to a trained model's).

The file is written tensor by tensor in chunks of blocks: one chunk (16 MiB) is in memory at a
time, whatever the file's size (an expert stack is no exception). The writer's peak memory (about
210 MB) is mostly gguf's reader parsing the tokenizer's 98k strings.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from ..config import default_cache_dir
from ..durable import DurableFile, disk_error
from ..errors import ConfigError
from ..store.atomic_dir import OutputError
from .synthetic import QK_NORM_TYPES, SHAPES
from ..convert.gguf_quantize import _pack_scales_k4
from ..convert.gguf_tokenizer import tokenizer_fields as fields_of
from ..default_model import default_model_path
from ..units import fmt

# quant name -> (GGML block type, llama.cpp file type), both as their gguf-py enum names. Q4_K_M is a
# mix, as llama.cpp's quantizer makes it (tensor_type): Q4_K, with Q6_K for the output matrix and for
# attn_v and ffn_down in the layers llama.cpp gives more bits.
QUANTS = {
    "Q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "Q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "Q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "Q4_K_M": ("Q4_K", "MOSTLY_Q4_K_M"),
}
WEIGHT_RANGE = 0.02  # a block's weights span about [-WEIGHT_RANGE, WEIGHT_RANGE] before jitter
SCALE_JITTER = 0.25  # each block's scale is the nominal one times 1 +- this (uniform)
_CHUNK = 16 << 20  # bytes of blocks generated at once


def default_path(shape: str, quant: str = "Q4_1", layers: int | None = None) -> str:
    """`<cache>/synthetic/<shape>-<quant>[-L<layers>].gguf`."""
    suffix = f"-L{layers}" if layers else ""
    return os.path.join(default_cache_dir(), "synthetic", f"{shape}-{quant}{suffix}.gguf")


def _scales(rng, n: int, nominal: float) -> np.ndarray:
    """[n] float16 block scales: `nominal` times a uniform jitter of +-SCALE_JITTER."""
    u = rng.random(n, dtype=np.float32)
    return (nominal * (1 + SCALE_JITTER * (2 * u - 1))).astype(np.float16)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(quant: str, name: str, layers: int) -> str:
    """The block type of tensor `name` in a file of `quant` (the mix's rule for Q4_K_M)."""
    if quant != "Q4_K_M":
        return QUANTS[quant][0]
    if name == "output.weight":
        return "Q6_K"
    if name.startswith("blk.") and name.split(".")[2] in ("attn_v", "ffn_down", "ffn_down_exps"):
        return "Q6_K" if more_bits(int(name.split(".")[1]), layers) else "Q4_K"
    return "Q4_K"


def _k_blocks(rng, kind: str, n: int) -> np.ndarray:
    """Random Q4_K / Q6_K blocks whose weights are centred, |w| <= about WEIGHT_RANGE.
    Q4_K: w = d sc q - dmin m with dmin = d, sc in 4..8 and m = round(7.5 sc) (so w ~ d sc (q - 7.5));
    Q6_K: w = d sc (q - 32), sc in 8..16."""

    out = np.frombuffer(rng.bytes(n * (144 if kind == "Q4_K" else 210)), np.uint8).reshape(n, -1).copy()
    if kind == "Q4_K":
        d = _scales(rng, n, WEIGHT_RANGE / (8 * 7.5)).view(np.uint8).reshape(n, 2)
        sc = rng.integers(4, 9, (n, 8))
        out[:, 0:2], out[:, 2:4] = d, d
        out[:, 4:16] = _pack_scales_k4(sc, np.rint(7.5 * sc).astype(np.int64))
    else:
        out[:, 192:208] = rng.integers(8, 17, (n, 16)).astype(np.int8).view(np.uint8)
        out[:, 208:210] = _scales(rng, n, WEIGHT_RANGE / (16 * 32)).view(np.uint8).reshape(n, 2)
    return out


def random_blocks(rng, quant: str, n: int) -> np.ndarray:
    """[n, block bytes] uint8: `n` random blocks of `quant` in llama.cpp's layout, each block's
    weights symmetric about 0 (a shared offset would add the same vector to every output row).
    Q4_0 (18 B: f16 d, 32 nibbles q): w = d (q - 8), q in 1..15 (a drawn 0 becomes 8, a zero weight);
    Q4_1 (20 B: f16 d, f16 m, 32 nibbles q): w = d q + m with m = -7.5 d;
    Q8_0 (34 B: f16 d, 32 int8 q): w = d q, q in -127..127 (a drawn -128 becomes 0)."""
    if quant in ("Q4_K", "Q6_K"):
        return _k_blocks(rng, quant, n)
    if quant == "Q8_0":
        d, width, nq = _scales(rng, n, WEIGHT_RANGE / 128), 34, 32
        head = d.view(np.uint8).reshape(n, 2)
    elif quant == "Q4_0":
        d, width, nq = _scales(rng, n, WEIGHT_RANGE / 8), 18, 16
        head = d.view(np.uint8).reshape(n, 2)
    elif quant == "Q4_1":
        d, width, nq = _scales(rng, n, WEIGHT_RANGE / 8), 20, 16
        m = (-7.5 * d.astype(np.float32)).astype(np.float16)
        head = np.stack([d, m], axis=1).view(np.uint8).reshape(n, 4)
    else:
        raise ConfigError(f"GGUF quantization {quant!r} is unknown (choose one of: {', '.join(QUANTS)})")
    out = np.empty((n, width), np.uint8)
    out[:, : head.shape[1]] = head
    q = np.frombuffer(rng.bytes(n * nq), np.uint8).reshape(n, nq)
    if quant == "Q4_0":
        lo, hi = q & 0x0F, q & 0xF0
        q = np.where(lo == 0, 0x08, lo) | np.where(hi == 0, 0x80, hi)
    elif quant == "Q8_0":
        q = np.where(q == 0x80, 0, q)
    out[:, head.shape[1] :] = q
    return out


def tokenizer_fields(path: str) -> dict:
    """Every `tokenizer.*` field of the GGUF at `path`: key -> (value, type, array item type or None)."""
    from gguf import GGUFValueType

    out = {}
    for key, field in fields_of(path, "no vocabulary to copy").items():
        if key.startswith("tokenizer."):
            vtype = GGUFValueType(field.vtype)
            out[key] = (field.value, vtype, GGUFValueType(field.item_type) if vtype == GGUFValueType.ARRAY else None)
    return out


# A MoE shape's attn_norm weight (see the module's docstring): 2^-7 keeps the spread over 48 layers,
# 2^-5 does not; 2^-10 leaves room.
ATTN_GAIN = 2.0**-10

# model_type -> llama.cpp architecture written (the converter reads these back).
ARCHS = {"llama": "llama", "qwen3_moe": "qwen3moe"}


def plan_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape in numpy order [.., out, in], kind) of each tensor, in llama.cpp's names and file
    order (token_embd, the blocks, output_norm, output). kind: "quant" (random blocks), "ones" (a
    float32 norm), "attn_gain" (a MoE shape's attn_norm: ATTN_GAIN) or "router" (random float32). A MoE
    layer's experts are three 3-D tensors, experts outermost, after its router."""
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    moe = bool(cfg.get("num_experts"))
    hd, H, Hk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    plan = [("token_embd.weight", (V, D), "quant")]
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (D,), "attn_gain" if moe else "ones"),
            (b + "attn_q.weight", (H * hd, D), "quant"),
            (b + "attn_k.weight", (Hk * hd, D), "quant"),
            (b + "attn_v.weight", (Hk * hd, D), "quant"),
            (b + "attn_output.weight", (D, H * hd), "quant"),
        ]
        if cfg["model_type"] in QK_NORM_TYPES:
            plan += [(b + "attn_q_norm.weight", (hd,), "ones"), (b + "attn_k_norm.weight", (hd,), "ones")]
        plan.append((b + "ffn_norm.weight", (D,), "ones"))
        plan += _ffn_plan(cfg, b)
    plan += [("output_norm.weight", (D,), "ones"), ("output.weight", (V, D), "quant")]
    return plan


def _ffn_plan(cfg: dict, b: str) -> list[tuple[str, tuple[int, ...], str]]:
    D = cfg["hidden_size"]
    E = cfg.get("num_experts", 0)
    if not E:
        F = cfg["intermediate_size"]
        return [
            (b + "ffn_gate.weight", (F, D), "quant"),
            (b + "ffn_up.weight", (F, D), "quant"),
            (b + "ffn_down.weight", (D, F), "quant"),
        ]
    F = cfg["moe_intermediate_size"]
    return [
        (b + "ffn_gate_inp.weight", (E, D), "router"),
        (b + "ffn_gate_exps.weight", (E, F, D), "quant"),
        (b + "ffn_up_exps.weight", (E, F, D), "quant"),
        (b + "ffn_down_exps.weight", (E, D, F), "quant"),
    ]


def shape_config(shape: str, layers: int | None = None) -> dict:
    """The shape's config with `layers` layers (all when None); refused for a shape llama.cpp's GGUF
    cannot hold as our converter reads it back (a MoE other than qwen3_moe, dense layers in a MoE)."""
    if shape not in SHAPES:
        raise ConfigError(f"synthetic shape {shape!r} is unknown (choose one of: {', '.join(SHAPES)})")
    cfg = dict(SHAPES[shape])
    model_type = cfg["model_type"]
    if model_type not in ARCHS:
        what = "a mixture of experts" if cfg.get("num_experts") else "an architecture"
        raise ConfigError(
            f"synthetic shape {shape!r} is {what} of model_type {model_type!r}: --format gguf writes "
            f"{', '.join(ARCHS)} only (the converter reads no other from a GGUF); "
            "use --format store for it"
        )
    if cfg.get("num_experts") and (int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers")):
        raise ConfigError(
            f"synthetic shape {shape!r} has dense layers between its MoE layers "
            "(decoder_sparse_step / mlp_only_layers), which llama.cpp's qwen3moe cannot hold"
        )
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"layers must be at least 1 (got {layers})")
        cfg["num_hidden_layers"] = int(layers)
    return cfg


def _tensor_bytes(shp: tuple[int, ...], kind: str, block: int, block_bytes: int) -> int:
    rows = int(np.prod(shp[:-1], dtype=np.int64))
    return rows * (shp[-1] // block) * block_bytes if kind == "quant" else 4 * rows * shp[-1]


def _add_metadata(w, cfg: dict, shape: str, quant: str, seed: int, tok: dict) -> None:
    from gguf import LlamaFileType

    L = cfg["num_hidden_layers"]
    w.add_name(f"synthetic {shape} {quant} (random weights)")
    w.add_description(
        f"synthetic checkpoint: random {quant} weights of the {shape} shape, seed {seed}, "
        f"{L} layers; results measured on it are synthetic"
    )
    w.add_file_type(LlamaFileType[QUANTS[quant][1]])
    w.add_quantization_version(2)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if cfg.get("num_experts"):
        # Qwen3-MoE's dense intermediate_size (unused by its layers) is K expert widths (6144 =
        # 8 x 768), which is also what llama.cpp divides by K when the expert width is absent.
        w.add_feed_forward_length(cfg["num_experts_per_tok"] * cfg["moe_intermediate_size"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    else:
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])  # Qwen3's heads are wider than d_model / heads
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    for key, (value, vtype, sub) in tok.items():
        w.add_key_value(key, value, vtype, sub_type=sub)


def _router(rng, shp: tuple[int, int]) -> np.ndarray:
    """[E, D] float32 of standard deviation 1/sqrt(D): an RMS-normalized input gets router logits of
    standard deviation about 1, so each token's top-k is its own and the softmax weights are not
    one-hot."""
    return (rng.standard_normal(shp, dtype=np.float32) / np.sqrt(shp[-1])).astype(np.float32)


def _float_tensor(rng, kind: str, shp: tuple) -> np.ndarray:
    if kind == "router":
        return _router(rng, shp)
    return np.full(shp, ATTN_GAIN if kind == "attn_gain" else 1.0, np.float32)


def write_synthetic_gguf(
    path: str | None = None,
    shape: str = "llama-2-7b",
    quant: str = "Q4_1",
    layers: int | None = None,
    seed: int = 0,
    progress: bool = True,
    tokenizer: str | dict | None = None,
) -> str:
    """Write a synthetic GGUF of `shape` (only its first `layers` layers if given) with random
    `quant` blocks for every matrix (token_embd, output and every expert included), float32 norms of
    ones and, for a MoE shape, random float32 routers; return its path (default:
    `default_path(shape, quant, layers)`). A dense shape is llama.cpp's `llama` architecture, a
    qwen3_moe shape its `qwen3moe` (experts as 3-D ffn_{gate,up,down}_exps tensors).

    The tokenizer is the default model's (SmolLM2's 49152-token byte-level BPE), or another GGUF's
    when `tokenizer` is its path (or the fields `tokenizer_fields` read from one, to read them once
    for several files): every `tokenizer.*` field is copied, and the shape's vocab_size is replaced
    by the tokenizer's token count (a Llama-2-7B shape here has 49152 embedding rows, not 32000).
    The file is written durably (durable.DurableFile: a temporary renamed when complete); one chunk of blocks is
    in memory at a time. Refused with a ConfigError for an unknown shape or quant, a shape with no
    GGUF architecture here (see `shape_config`), or (an OutputError) too little free disk space."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
    from tqdm import tqdm

    if quant not in QUANTS:
        raise ConfigError(f"GGUF quantization {quant!r} is unknown (choose one of: {', '.join(QUANTS)})")
    cfg = shape_config(shape, layers)
    if tokenizer is None:
        tokenizer = default_model_path()
    tok = tokenizer_fields(tokenizer) if isinstance(tokenizer, str) else tokenizer
    cfg["vocab_size"] = len(tok["tokenizer.ggml.tokens"][0])
    plan = plan_tensors(cfg)
    types = {name: tensor_type(quant, name, cfg["num_hidden_layers"]) for name, _, kind in plan if kind == "quant"}
    sizes = {t: GGML_QUANT_SIZES[GGMLQuantizationType[t]] for t in set(types.values())}  # (block, block bytes)
    for name, shp, kind in plan:
        if kind == "quant" and shp[-1] % sizes[types[name]][0]:
            raise ConfigError(
                f"{shape}: {name} rows of {shp[-1]} are not a multiple of the {types[name]} block "
                f"({sizes[types[name]][0]})"
            )
    nbytes = [
        _tensor_bytes(shp, kind, *(sizes[types[name]] if kind == "quant" else (1, 1))) for name, shp, kind in plan
    ]

    path = os.path.abspath(path or default_path(shape, quant, layers))
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise disk_error(OutputError, folder, e) from None
    total = sum(nbytes)
    need = total + len(plan) * 32 + (8 << 20)  # alignment and metadata (the vocabulary is ~2 MB)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise OutputError(f"{path}: the disk is full (needs {fmt(need)}, {fmt(free)} free)", full=True)

    w = GGUFWriter(None, ARCHS[cfg["model_type"]])
    _add_metadata(w, cfg, shape, quant, seed, tok)
    for (name, shp, kind), n in zip(plan, nbytes):
        if kind == "quant":  # a byte shape [.., out, in / block * block bytes]; gguf-py turns it into elements
            block, block_bytes = sizes[types[name]]
            w.add_tensor_info(
                name,
                (*shp[:-1], shp[-1] // block * block_bytes),
                np.dtype(np.uint8),
                n,
                raw_dtype=GGMLQuantizationType[types[name]],
            )
        else:
            w.add_tensor_info(name, shp, np.dtype(np.float32), n)

    rng = np.random.default_rng(seed)
    # gguf-py renders the header (metadata and tensor infos, small) into a file of its own; its bytes
    # then open the durable file the tensors are written to (os.write, fsync, rename)
    head = path + ".head"
    try:
        w.write_header_to_file(Path(head))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
    finally:
        w.close()
    with open(head, "rb") as f:
        header = f.read()
    os.unlink(head)
    with DurableFile(path, OutputError, needed=need) as fh:
        fh.write(header)
        fh.pad_to(w.data_alignment)
        start = fh.tell()
        offset = 0
        with tqdm(
            total=total, unit="B", unit_scale=True, desc=f"synthetic {shape} {quant}", disable=not progress
        ) as bar:
            for (name, shp, kind), n in zip(plan, nbytes):
                assert fh.tell() - start == offset, name  # tensor infos hold these offsets
                if kind == "quant":
                    block_bytes = sizes[types[name]][1]
                    left = n // block_bytes
                    while left:
                        k = min(left, _CHUNK // block_bytes)
                        fh.write(random_blocks(rng, types[name], k).data)
                        left -= k
                        bar.update(k * block_bytes)
                else:  # a router or a norm
                    fh.write(_float_tensor(rng, kind, shp).tobytes())
                    bar.update(n)
                fh.pad_to(w.data_alignment)  # (every tensor starts aligned, so this pads n)
                offset += GGUFWriter.ggml_pad(n, w.data_alignment)
    return path
