"""A GGUF as llama.cpp's Q4_K_M files are (Gemma 3: Q5_0 rows of d_model, Q4_K and Q6_K down projections
alternating by layer, a Q8_0 embedding, norms stored as 1 + w) converted with every tensor kept in
its own type, the store holding the file's bytes, and its logits equal to transformers' reading the
same file, on both backends, over a prompt longer than the sliding window."""

import numpy as np
import pytest

from mlx_flash.convert import convert
from mlx_flash.convert.gguf_quantize import quantize_k
from mlx_flash.store import open_store

gguf = pytest.importorskip("gguf")
D, HEADS, HEAD_DIM, FF, LAYERS, WINDOW = 64, 1, 256, 512, 6, 8
TEXT = ("The river rises in the northern hills and flows south through farmland, past two market towns and "
        "an old stone bridge, before it widens into a marsh where herons feed in the shallow water.")


def _tensor(w, name, a, kind):
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        w.add_tensor(name, a.astype(np.float32))
    elif kind in ("Q4_K", "Q5_K", "Q6_K"):
        w.add_tensor(name, quantize_k(a, kind), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def write_gemma3_gguf(path, default_gguf, seed=0) -> dict:
    """A tiny random Gemma 3 GGUF with the default model's vocabulary; returns {GGUF name: type}."""
    from mlx_flash.calibrate.synthetic_gguf import tokenizer_fields

    tok = tokenizer_fields(default_gguf)
    vocab = len(tok["tokenizer.ggml.tokens"][0])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in {"context_length": 512, "embedding_length": D, "block_count": LAYERS, "feed_forward_length": FF,
                       "attention.head_count": HEADS, "attention.head_count_kv": 1, "attention.key_length": HEAD_DIM,
                       "attention.value_length": HEAD_DIM, "attention.sliding_window": WINDOW}.items():
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("gemma3.rope.freq_base", 1_000_000.0)
    for key, (value, vtype, sub) in tok.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    types = {}

    def add(name, shape, kind, scale):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name.endswith("norm.weight"):
            a = 1 + a  # stored as 1 + w, as llama.cpp's converter writes Gemma's norms
        _tensor(w, name, a, kind)
        types[name] = kind

    add("token_embd.weight", (vocab, D), "Q8_0", 0.5)
    add("output_norm.weight", (D,), "F32", 0.1)
    for i in range(LAYERS):
        b = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            add(b + n + ".weight", (D,), "F32", 0.1)
        add(b + "attn_q_norm.weight", (HEAD_DIM,), "F32", 0.1)
        add(b + "attn_k_norm.weight", (HEAD_DIM,), "F32", 0.1)
        add(b + "attn_q.weight", (HEADS * HEAD_DIM, D), "Q5_0", 0.125)
        add(b + "attn_k.weight", (HEAD_DIM, D), "Q5_0", 0.125)
        add(b + "attn_v.weight", (HEAD_DIM, D), "Q5_1" if i % 2 else "Q8_0", 0.125)
        add(b + "attn_output.weight", (D, HEADS * HEAD_DIM), "Q4_K", 0.06)
        add(b + "ffn_gate.weight", (FF, D), "Q5_0", 0.125)
        add(b + "ffn_up.weight", (FF, D), "Q5_0", 0.125)
        add(b + "ffn_down.weight", (D, FF), "Q6_K" if i % 2 else "Q4_K", 0.04)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory, default_gguf):
    path = tmp_path_factory.mktemp("kq") / "tiny-gemma3-q4_k_m.gguf"
    write_gemma3_gguf(path, default_gguf)
    return str(path)


@pytest.fixture(scope="module")
def gemma3_store(gemma3_gguf, tmp_path_factory):
    return convert(gemma3_gguf, str(tmp_path_factory.mktemp("kq") / "store"), progress=False)


def test_every_tensor_keeps_its_type_and_bytes(gemma3_gguf, gemma3_store):
    store = open_store(gemma3_store, False, False)
    m = store.manifest
    q = m.quant
    assert q["model.layers.0.self_attn.q_proj"].kind == "Q5_0"
    assert q["model.layers.0.self_attn.o_proj"].kind == "Q4_K"
    assert q["model.layers.1.self_attn.v_proj"].kind == "Q5_1"
    assert q["model.layers.0.self_attn.v_proj"].kind is None and q["model.layers.0.self_attn.v_proj"].bits == 8
    # the FFN: Q5_0 gate/up rows, down in Q4_K (even layers) and Q6_K (odd), bundles of 256 neurons
    assert m.ffn.block == 256 and [lq["down"].kind for lq in m.ffn.layer_quant] == ["Q4_K", "Q6_K"] * 3
    assert {lq["gate"].kind for lq in m.ffn.layer_quant} == {"Q5_0"}
    # a resident tensor is the file's bytes
    reader = gguf.GGUFReader(gemma3_gguf)
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_output.weight")
    stored, _ = store.read_resident(())["model.layers.0.self_attn.o_proj.weight"]
    assert np.array_equal(np.asarray(stored).reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))


def _transformers_logits(gguf_path, ids):
    import os

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path),
                                                              gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.slow
def test_logits_equal_transformers_reading_the_same_file(gemma3_gguf, gemma3_store):
    import mlx_flash

    ids = None
    for backend in ("torch", "mlx"):
        with mlx_flash.load(gemma3_store, backend=backend, progress=False) as engine:
            ids = ids or engine.tokenizer.encode(TEXT)[:40]  # 40 tokens: 5 windows of 8
            ours = np.asarray(engine.logits(ids))
            if backend == "torch":
                ref = _transformers_logits(gemma3_gguf, ids)
            err = np.abs(ours - ref).max() / np.abs(ref).max()
            assert err < 1e-5, f"{backend}: relative logit error {err:.2e} against transformers"
