"""Checks of a manifest that go past each field's own range (schema.py): the FFN bundle's fields are
the parts the FFN computes with, in the shapes d_model gives, and the tensors every family names
alike have the shapes the config's dimensions give. A store edited consistently enough to pass the
byte-range checks (or re-sealed by hand) is refused here, with one line naming the tensor or field,
instead of failing as a shape error inside a matmul at load or at the first token."""

from __future__ import annotations

from ..errors import StoreError
from ..quant_spec import BLOCKS

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# The parts of a linear a bundle field may hold (weights.PARTS): `<matrix>.<part>`.
FFN_PARTS = ("weight", "scales", "biases", "bias")


def check_ffn_fields(store_dir: str, ffn, fields, quant, down_rows: bool) -> None:
    """The bundle's fields are the parts of gate (when gated), up and down the FFN computes with:
    each matrix's weight, its scales and biases exactly when `quant` says it is quantized."""
    matrices = ("gate", "up", "down") if ffn.gated else ("up", "down")
    names = [fl.name for fl in fields]
    for name in names:
        matrix, _, part = name.partition(".")
        if matrix not in matrices or part not in FFN_PARTS or names.count(name) > 1:
            raise StoreError(
                f"{store_dir}: FFN bundle field {name!r} is unknown or repeated (fields are "
                f"<{'|'.join(matrices)}>.<{'|'.join(FFN_PARTS)}>, each once)"
            )
    for k in quant:
        if k not in matrices:
            raise StoreError(f"{store_dir}: FFN quantization names {k!r}, which is not a matrix of this FFN")
    for matrix in matrices:
        q = quant.get(matrix)
        need = {"weight"} | ({"scales", "biases"} if q is not None and not q.is_block else set())
        have = {n.partition(".")[2] for n in names if n.startswith(matrix + ".")} - {"bias"}
        if have != need:
            raise StoreError(
                f"{store_dir}: FFN bundles hold {sorted(have)} of {matrix} but its quantization "
                f"({quant.get(matrix)}) needs {sorted(need)}"
            )
    if ffn.block != 1 or down_rows:  # blocks are checked by their lead axis (Manifest.validate)
        return
    d = ffn.d_model
    for fl in fields:  # one neuron's gate row, up row, down column: d_model values, or their codes
        matrix, _, part = fl.name.partition(".")
        q = quant.get(matrix)
        if part == "bias":
            continue
        if q is None:
            shape, dtypes = [d], FLOAT_DTYPES
        elif part == "weight":
            shape, dtypes = [d * q.bits // 32], ("uint32",)
        else:
            shape, dtypes = [d // q.group_size], FLOAT_DTYPES
        if fl.shape != shape or fl.dtype not in dtypes:
            raise StoreError(
                f"{store_dir}: FFN bundle field {fl.name} is {fl.dtype} {fl.shape} but d_model "
                f"{d} ({q or 'float rows'}) needs {' or '.join(dtypes)} {shape}"
            )


def check_block_fields(store_dir: str, ffn) -> None:
    """FFN matrices kept in GGUF block types: each layer's quantization (ffn.layer_quant, one per
    layer, or ffn.quant for all) names the same matrices as ffn.quant, the affine ones alike, and a
    block type's rows fit its uint8 field: gate/up rows of d_model weights, the down matrix's one block
    per d_model row, with bundles of one block of neurons."""
    layers = ffn.layer_quant or [ffn.quant]
    if ffn.layer_quant and len(ffn.layer_quant) != len(ffn.layer_offsets):
        raise StoreError(
            f"{store_dir}: ffn.layer_quant lists {len(ffn.layer_quant)} layers, not {len(ffn.layer_offsets)}"
        )
    fields = {fl.name: fl for fl in ffn.fields}
    for layer, quant in enumerate(layers):
        if set(quant) != set(ffn.quant):
            raise StoreError(f"{store_dir}: FFN layer {layer} quantizes {sorted(quant)}, not {sorted(ffn.quant)}")
        for matrix, q in quant.items():
            base = ffn.quant[matrix]
            if q is None or not q.is_block or base is None or not base.is_block:
                if q != base:
                    raise StoreError(f"{store_dir}: FFN layer {layer} quantizes {matrix} as {q}, the layout as {base}")
                continue
            blk, fl = BLOCKS[q.kind], fields.get(f"{matrix}.weight")
            need = blk.nbytes if matrix == "down" else blk.row_bytes(ffn.d_model)
            if matrix == "down" and ffn.block != blk.weights:
                raise StoreError(
                    f"{store_dir}: FFN down in {q.kind} needs bundles of {blk.weights} neurons "
                    f"(the layout has {ffn.block})"
                )
            if matrix != "down" and ffn.d_model % blk.weights:
                raise StoreError(f"{store_dir}: FFN {matrix} in {q.kind} needs d_model a multiple of {blk.weights}")
            if fl is None or fl.dtype != "uint8" or len(fl.shape) != 2 or fl.shape[1] < need:
                raise StoreError(
                    f"{store_dir}: FFN bundle field {matrix}.weight cannot hold {q.kind} rows of "
                    f"{need} bytes (layer {layer})"
                )


def check_against_config(store_dir: str, manifest) -> None:
    """The shapes of the tensors every family names alike agree with the config's dimensions, so
    an edited width or head count is refused here and not met as a shape error inside a matmul."""
    c, f = manifest.config, manifest.ffn
    hidden = c["hidden_size"]
    if f.d_model != hidden:
        raise StoreError(f"{store_dir}: ffn.d_model {f.d_model} is not the config's hidden_size {hidden}")
    if "intermediate_size" in c and f.n_neurons != c["intermediate_size"]:
        raise StoreError(
            f"{store_dir}: ffn.n_neurons {f.n_neurons} is not the config's intermediate_size {c['intermediate_size']}"
        )
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads") or heads
    embed = c.get("word_embed_proj_dim") or hidden
    vocab = c["vocab_size"]
    # name -> the shapes it may have
    want = {
        "model.embed_tokens.weight": [[vocab, embed]],
        "model.decoder.embed_tokens.weight": [[vocab, embed]],
        "lm_head.weight": [[vocab, embed]],
        "model.norm.weight": [[hidden]],
    }
    for layer in range(c["num_hidden_layers"]):
        for prefix in (f"model.layers.{layer}.", f"model.decoder.layers.{layer}."):
            a = prefix + "self_attn."
            want.update(
                {
                    a + "q_proj.weight": [[heads * head_dim, hidden]],
                    a + "k_proj.weight": [[kv * head_dim, hidden]],
                    a + "v_proj.weight": [[kv * head_dim, hidden]],
                    a + "o_proj.weight": [[hidden, heads * head_dim]],
                    a + "out_proj.weight": [[hidden, heads * head_dim]],
                    # per head (qwen3) or over the whole projection (olmoe)
                    a + "q_norm.weight": [[head_dim], [heads * head_dim]],
                    a + "k_norm.weight": [[head_dim], [kv * head_dim]],
                    prefix + "input_layernorm.weight": [[hidden]],
                    prefix + "post_attention_layernorm.weight": [[hidden]],
                }
            )
    for name, t in manifest.tensors.items():
        if name not in want:
            continue
        q = manifest.quant.get(name[: -len(".weight")])
        quantized = q is not None
        if t.dtype not in ((("uint8",) if q.is_block else ("uint32",)) if quantized else FLOAT_DTYPES):
            raise StoreError(
                f"{store_dir}: tensor {name} is stored as {t.dtype}, which is not a "
                f"{'quantized weight' if quantized else 'float'} dtype"
            )
        if logical_shape(manifest, name) not in want[name]:
            raise StoreError(
                f"{store_dir}: tensor {name} has shape {logical_shape(manifest, name)} but the config "
                f"(hidden_size {hidden}, heads {heads}x{head_dim}, kv heads {kv}, vocab {vocab}) "
                f"needs {' or '.join(map(str, want[name]))}"
            )


def logical_shape(manifest, name: str) -> list[int]:
    """A tensor's shape as the model sees it: a quantized weight's packed words unpacked."""
    t = manifest.tensors[name]
    q = manifest.quant.get(name[: -len(".weight")]) if name.endswith(".weight") else None
    if q is None or not t.shape:
        return list(t.shape)
    if q.is_block:  # rows of whole blocks
        return [*t.shape[:-1], t.shape[-1] // BLOCKS[q.kind].nbytes * BLOCKS[q.kind].weights]
    return [*t.shape[:-1], t.shape[-1] * 32 // q.bits]
