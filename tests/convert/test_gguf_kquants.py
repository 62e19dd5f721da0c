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
TEXT = (
    "The river rises in the northern hills and flows south through farmland, past two market towns and "
    "an old stone bridge, before it widens into a marsh where herons feed in the shallow water."
)


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
    for key, value in {
        "context_length": 512,
        "embedding_length": D,
        "block_count": LAYERS,
        "feed_forward_length": FF,
        "attention.head_count": HEADS,
        "attention.head_count_kv": 1,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "attention.sliding_window": WINDOW,
    }.items():
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
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
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


@pytest.mark.full  # ~8 s: a second conversion of the file; the default tier converts it whole
def test_a_split_file_converts_as_the_whole_one(gemma3_gguf, gemma3_store, tmp_path):
    """llama.cpp's gguf-split layout (`-00001-of-0000N.gguf`, split.* metadata): any part's path names
    the model; the store is the whole file's, tensor for tensor; a missing part is named."""
    import os

    reader = gguf.GGUFReader(gemma3_gguf)
    w = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "gemma3", split_max_tensors=30)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        w.add_key_value(
            key, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        )
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(p for p in os.listdir(tmp_path) if p.endswith(".gguf"))
    assert len(parts) > 2 and parts[1].endswith(f"-00002-of-{len(parts):05d}.gguf"), parts
    split = convert(str(tmp_path / parts[1]), str(tmp_path / "store"), progress=False)
    a, b = open_store(split, False, False), open_store(gemma3_store, False, False)
    assert a.manifest.quant == b.manifest.quant and a.manifest.ffn.layer_quant == b.manifest.ffn.layer_quant
    ra, rb = a.read_resident(()), b.read_resident(())
    assert ra.keys() == rb.keys()
    assert all(np.array_equal(np.asarray(ra[k][0]), np.asarray(rb[k][0])) for k in ra)
    with (
        open(os.path.join(split, "ffn_bundles.bin"), "rb") as fa,
        open(os.path.join(gemma3_store, "ffn_bundles.bin"), "rb") as fb,
    ):
        assert fa.read() == fb.read()
    os.remove(tmp_path / parts[-1])
    from mlx_flash.errors import ModelFileError

    with pytest.raises(ModelFileError, match=rf"1 of the {len(parts)} parts of this split GGUF are missing"):
        convert(str(tmp_path / parts[0]), str(tmp_path / "store2"), progress=False)


def test_q8_converts_block_types_to_rows_the_sparse_ffn_reads(gemma3_gguf, gemma3_store, tmp_path):
    """`--precision q8` (named, lossy: the block values re-quantized to affine 8-bit) turns the Q5_0 /
    Q4_K / Q6_K FFN into one-neuron bundles the sparse kernel reads; its logits stay within the
    8-bit rounding of the file's, and a sparse FFN with every neuron active equals its resident run."""
    import mlx_flash

    q8 = convert(gemma3_gguf, str(tmp_path / "q8"), precision="q8", progress=False)
    lay = open_store(q8, False, False).manifest.ffn
    assert (lay.block, lay.has_blocks) == (1, False)
    assert {q.bits for q in lay.quant.values()} == {8} and not lay.layer_quant
    with mlx_flash.load(gemma3_store, backend="torch", progress=False) as e:
        ids = e.tokenizer.encode(TEXT)[:20]
        want = np.asarray(e.logits(ids))

    def steps(engine):  # token by token: decode steps, the sparse kernel's path
        caches = engine.new_caches()
        return np.stack([np.asarray(engine.forward([t], caches)).reshape(-1) for t in ids])

    with mlx_flash.load(q8, backend="torch", ffn="resident", progress=False) as e:
        assert np.abs(np.asarray(e.logits(ids)) - want).max() / np.abs(want).max() < 1e-2
        dense = steps(e)
    with mlx_flash.load(
        q8,
        backend="torch",
        ffn="sparse",
        weights_budget="200%",
        progress=False,
        flash=mlx_flash.FlashOptions(mode="all", predictor="dense"),
    ) as e:
        assert e.ffn.stats().sparse_kernel == "cpu"
        assert np.array_equal(steps(e), dense)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_sparse_modes_on_block_types_equal_resident(gemma3_store, backend):
    """ffn="sparse" over bundles of whole super-blocks (256 neurons; Q4_K and Q6_K layers mixed): every
    exact mode, rows through the reference path (the sparse kernels read affine groups), equals the
    resident model bit for bit; each layer's rows are read in that layer's type."""
    import mlx_flash
    from greedy import greedy

    ids = list(range(5, 25))
    with mlx_flash.load(gemma3_store, backend=backend, ffn="resident", progress=False) as e:
        want = greedy(e, ids, 6)
    for mode in ("naive", "hybrid", "window", "all"):
        with mlx_flash.load(
            gemma3_store,
            backend=backend,
            ffn="sparse",
            weights_budget="200%",
            progress=False,
            io=mlx_flash.IOOptions(mode="buffered"),
            flash=mlx_flash.FlashOptions(mode=mode, predictor="dense"),
        ) as e:
            got = greedy(e, ids, 6)
            assert e.ffn.stats().sparse_kernel in ("", "reference"), mode
        assert got[0] == want[0] and np.array_equal(got[1], want[1]), mode


def test_gate_predictor_reads_block_gate_rows(gemma3_store, tmp_path):
    """The gate predictor over a block-type FFN (Q5_0 gate/up rows, GeGLU) takes the rows' values
    into its 4-bit copy: at threshold 0 it selects every neuron with a nonzero activation, so the
    sparse FFN equals the resident one; at a high threshold it selects fewer and the output moves."""
    import json
    import shutil

    import mlx_flash
    from greedy import greedy
    from mlx_flash.sparse.predictor import LayerPredictor, Predictors

    store = shutil.copytree(gemma3_store, str(tmp_path / "store"))
    lay = open_store(store, False, False).manifest.ffn
    n = len(lay.layer_offsets)

    def thresholds(t):
        Predictors(
            [
                LayerPredictor(
                    np.zeros((lay.d_model, 2), np.float32),
                    np.zeros((2, lay.n_neurons), np.float32),
                    np.zeros(lay.n_neurons, np.float32),
                    0.0,
                )
                for _ in range(n)
            ],
            0.5,
            [t] * n,
        ).save(store)
        meta = json.load(open(f"{store}/predictors.json"))
        assert meta["magnitude_thresholds"] == [t] * n

    ids = list(range(5, 25))
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False) as e:
        want = greedy(e, ids, 4)[1]
    runs = {}
    for t in (0.0, 1e3):
        thresholds(t)
        with mlx_flash.load(
            store,
            backend="torch",
            ffn="sparse",
            weights_budget="200%",
            progress=False,
            flash=mlx_flash.FlashOptions(mode="all", predictor="gate"),
            io=mlx_flash.IOOptions(mode="buffered"),
        ) as e:
            runs[t] = greedy(e, ids, 4)[1]
            st = e.ffn.stats()
        runs[t, "active"] = st.rows_active / (st.decode_layer_steps * st.neurons)
    assert np.array_equal(runs[0.0], want) and runs[0.0, "active"] > 0.99
    assert runs[1e3, "active"] < 0.5 and np.abs(runs[1e3] - want).max() > 1e-3
