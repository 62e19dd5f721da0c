"""Synthetic GGUF checkpoints: a small made-up shape parses with gguf's reader with llama.cpp's
tensor names, types and shapes, carries the default model's tokenizer metadata, holds small finite
centred weights in every quantization, converts into a store whose logits are finite, and bad
input is refused in one line. A small Qwen3-MoE shape is written as llama.cpp's qwen3moe (experts
as 3-D stacks), converts expert by expert into the experts gguf's own dequantization gives, and
gives llama.cpp's logits."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from mlx_flash.calibrate import synthetic, synthetic_gguf
from mlx_flash.errors import ConfigError
from mlx_flash.store.atomic_dir import OutputError

VOCAB = 49152  # the default model's tokenizer


def reduced(monkeypatch, name: str, base: str, **over) -> str:
    """A shape `name` for this test: the real shape `base` with `over` replaced."""
    monkeypatch.setitem(synthetic.SHAPES, name, dict(synthetic.SHAPES[base], **over))
    return name


@pytest.fixture
def small_moe(monkeypatch):
    """Qwen3-30B-A3B reduced: heads wider than d_model / heads (32 > 64 / 4), 4 experts of 64, top-2."""
    return reduced(
        monkeypatch,
        "small-moe",
        "qwen3-30b-a3b",
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=4 * 64,
    )


@pytest.fixture
def small_shape(monkeypatch):
    return reduced(
        monkeypatch,
        "small",
        "llama-2-7b",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


def expected_tensors(quant: str, layers: int) -> dict:
    q, f32 = GGMLQuantizationType[quant], GGMLQuantizationType.F32
    want = {"token_embd.weight": (q, [64, VOCAB]), "output_norm.weight": (f32, [64]), "output.weight": (q, [64, VOCAB])}
    for i in range(layers):  # gguf shapes are [in, out] (ggml's ne order)
        want.update(
            {
                f"blk.{i}.attn_norm.weight": (f32, [64]),
                f"blk.{i}.ffn_norm.weight": (f32, [64]),
                f"blk.{i}.attn_q.weight": (q, [64, 64]),
                f"blk.{i}.attn_k.weight": (q, [64, 32]),
                f"blk.{i}.attn_v.weight": (q, [64, 32]),
                f"blk.{i}.attn_output.weight": (q, [64, 64]),
                f"blk.{i}.ffn_gate.weight": (q, [64, 96]),
                f"blk.{i}.ffn_up.weight": (q, [64, 96]),
                f"blk.{i}.ffn_down.weight": (q, [96, 64]),
            }
        )
    return want


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    """The default model's tokenizer fields, read once (reading 98k strings takes seconds)."""
    return synthetic_gguf.tokenizer_fields(default_gguf)


# Q4_1 by default; the other two block types (~6 s) in the full tier (test_q4_k_m_* writes K-quants)
@pytest.mark.parametrize(
    "quant", ["Q4_1", pytest.param("Q4_0", marks=pytest.mark.full), pytest.param("Q8_0", marks=pytest.mark.full)]
)
def test_file_parses_with_llama_names_types_tokenizer_and_small_weights(tmp_path, small_shape, tokenizer, quant):
    path = synthetic_gguf.write_synthetic_gguf(
        str(tmp_path / "s.gguf"), small_shape, quant, layers=2, progress=False, tokenizer=tokenizer
    )
    r = GGUFReader(path)
    got = {t.name: (t.tensor_type, [int(n) for n in t.shape]) for t in r.tensors}
    assert got == expected_tensors(quant, 2)
    meta = {k: f.contents() for k, f in r.fields.items()}
    assert meta["general.architecture"] == "llama" and "synthetic" in meta["general.name"]
    assert meta["general.file_type"] == {"Q4_1": 3, "Q4_0": 2, "Q8_0": 7}[quant]
    assert {
        k: meta[f"llama.{k}"]
        for k in (
            "block_count",
            "embedding_length",
            "feed_forward_length",
            "attention.head_count",
            "attention.head_count_kv",
            "vocab_size",
            "rope.dimension_count",
            "context_length",
        )
    } == {
        "block_count": 2,
        "embedding_length": 64,
        "feed_forward_length": 96,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "vocab_size": VOCAB,
        "rope.dimension_count": 16,
        "context_length": 4096,
    }
    ours = {
        k: (v.contents(), v.types[0], v.types[-1] if len(v.types) > 1 else None)
        for k, v in r.fields.items()
        if k.startswith("tokenizer.")
    }
    assert ours == tokenizer  # every tokenizer.* field of the default model, same values and types
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        if t.tensor_type == GGMLQuantizationType.F32:
            assert (w == 1).all(), t.name  # norms of ones
        else:
            assert np.abs(w).max() <= 0.0251, t.name
            assert 0.008 < w.std() < 0.014 and abs(w.mean()) < 5e-4, (t.name, w.std(), w.mean())


@pytest.mark.full  # ~6 s; the default tier converts the Q4_K_M mix and the MoE file and checks their logits
def test_converts_into_a_store_with_finite_logits(tmp_path, small_shape, tokenizer):
    import mlx_flash
    from mlx_flash.convert import convert
    from mlx_flash.store import open_store

    path = synthetic_gguf.write_synthetic_gguf(
        str(tmp_path / "s.gguf"), small_shape, seed=1, progress=False, tokenizer=tokenizer
    )
    store = convert(path, str(tmp_path / "store"), progress=False)
    cfg = open_store(store).manifest.config
    assert (cfg["num_hidden_layers"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (3, VOCAB, False)
    with mlx_flash.load(store, progress=False) as engine:
        logits = engine.logits(engine.tokenizer.encode("The capital of France is"))
    assert logits.shape[-1] == VOCAB and np.isfinite(logits).all() and 0.05 < logits.std() < 10


def test_bad_input_is_refused_in_one_line(tmp_path, small_shape, tokenizer, monkeypatch):
    out = str(tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="'Q3_K' is unknown"):
        synthetic_gguf.write_synthetic_gguf(out, small_shape, "Q3_K", progress=False)
    with pytest.raises(ConfigError, match="'gpt-9' is unknown"):
        synthetic_gguf.write_synthetic_gguf(out, "gpt-9", progress=False)
    with pytest.raises(ConfigError, match="mixture of experts of model_type 'mixtral'"):
        synthetic_gguf.write_synthetic_gguf(out, "mixtral-8x7b", progress=False)
    monkeypatch.setitem(synthetic.SHAPES, "dense-between", dict(synthetic.SHAPES["qwen3-30b-a3b"], mlp_only_layers=[0]))
    with pytest.raises(ConfigError, match="dense layers between"):
        synthetic_gguf.write_synthetic_gguf(out, "dense-between", progress=False)
    monkeypatch.setattr(synthetic_gguf.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(OutputError, match=r"the disk is full \(needs .* MB, 0.0 MB free\)"):
        synthetic_gguf.write_synthetic_gguf(out, small_shape, progress=False, tokenizer=tokenizer)
    assert not list(tmp_path.iterdir())  # nothing written, not even a partial file


def expected_moe_tensors(quant: str, layers: int) -> dict:
    q, f32 = GGMLQuantizationType[quant], GGMLQuantizationType.F32
    want = {"token_embd.weight": (q, [64, VOCAB]), "output_norm.weight": (f32, [64]), "output.weight": (q, [64, VOCAB])}
    for i in range(layers):  # gguf shapes are [in, out(, experts)] (ggml's ne order)
        want.update(
            {
                f"blk.{i}.attn_norm.weight": (f32, [64]),
                f"blk.{i}.ffn_norm.weight": (f32, [64]),
                f"blk.{i}.attn_q.weight": (q, [64, 128]),
                f"blk.{i}.attn_k.weight": (q, [64, 64]),
                f"blk.{i}.attn_v.weight": (q, [64, 64]),
                f"blk.{i}.attn_output.weight": (q, [128, 64]),
                f"blk.{i}.attn_q_norm.weight": (f32, [32]),
                f"blk.{i}.attn_k_norm.weight": (f32, [32]),
                f"blk.{i}.ffn_gate_inp.weight": (f32, [64, 4]),
                f"blk.{i}.ffn_gate_exps.weight": (q, [64, 64, 4]),
                f"blk.{i}.ffn_up_exps.weight": (q, [64, 64, 4]),
                f"blk.{i}.ffn_down_exps.weight": (q, [64, 64, 4]),
            }
        )
    return want


def test_moe_file_is_qwen3moe_with_expert_stacks_and_random_routers(tmp_path, small_moe, tokenizer):
    path = synthetic_gguf.write_synthetic_gguf(
        str(tmp_path / "m.gguf"), small_moe, "Q8_0", layers=2, progress=False, tokenizer=tokenizer
    )
    r = GGUFReader(path)
    assert {t.name: (t.tensor_type, [int(n) for n in t.shape]) for t in r.tensors} == expected_moe_tensors("Q8_0", 2)
    meta = {k: f.contents() for k, f in r.fields.items()}
    assert meta["general.architecture"] == "qwen3moe"
    assert {
        k: meta[f"qwen3moe.{k}"]
        for k in (
            "block_count",
            "embedding_length",
            "feed_forward_length",
            "expert_feed_forward_length",
            "expert_count",
            "expert_used_count",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "attention.value_length",
            "rope.freq_base",
            "context_length",
        )
    } == {
        "block_count": 2,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "expert_feed_forward_length": 64,
        "expert_count": 4,
        "expert_used_count": 2,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 32,
        "attention.value_length": 32,
        "rope.freq_base": 1e6,
        "context_length": 40960,
    }
    routers = [dequantize(t.data, t.tensor_type) for t in r.tensors if t.name.endswith("ffn_gate_inp.weight")]
    assert not np.array_equal(routers[0], routers[1])  # each layer routes on its own
    for w in routers:  # logits of standard deviation ~1 for an RMS-normalized input
        assert 0.1 < w.std() < 0.15 and np.isfinite(w).all()
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type)
        if t.name.endswith("attn_norm.weight"):  # attention adds little: routing follows each token
            assert (w == np.float32(synthetic_gguf.ATTN_GAIN)).all(), t.name
        elif t.name.endswith("norm.weight"):
            assert (w == 1).all(), t.name
        elif "gate_inp" not in t.name:
            assert np.abs(w).max() <= 0.0251, t.name


def _expert_rows(store, layer: int, expert: int) -> dict:
    from mlx_flash.store.bundles import unpack_rows

    lay = store.manifest.ffn
    with open(store.file_path(lay.file), "rb") as fh:
        fh.seek(lay.expert_offset(layer, expert))
        raw = np.frombuffer(fh.read(lay.expert_nbytes), np.uint8).reshape(lay.expert_rows, lay.bundle_bytes)
    return unpack_rows(lay.fields, raw)


@pytest.mark.full  # ~9 s; by default an expert slot is checked to be its bytes as stored (test_block_experts.py)
def test_moe_converts_expert_by_expert_into_the_gguf_experts(tmp_path, small_moe, tokenizer, monkeypatch):
    from mlx_flash.convert import convert
    from mlx_flash.convert.tensor_source import GGUFTensors
    from mlx_flash.store import open_store

    path = synthetic_gguf.write_synthetic_gguf(
        str(tmp_path / "m.gguf"), small_moe, "Q4_1", progress=False, tokenizer=tokenizer
    )
    reads = []
    real_read = GGUFTensors._read
    monkeypatch.setattr(
        GGUFTensors, "_read", lambda self, off, n, name: reads.append((off, n)) or real_read(self, off, n, name)
    )
    store = open_store(convert(path, str(tmp_path / "store"), precision="f16", progress=False))
    cfg = store.manifest.config
    assert {
        k: cfg[k]
        for k in (
            "model_type",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "head_dim",
            "rope_traditional",
            "intermediate_size",
        )
    } == {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "head_dim": 32,
        "rope_traditional": False,
        "intermediate_size": 256,
    }
    assert store.manifest.ffn.n_experts == 4
    assert {"model.layers.2.mlp.gate.weight", "model.layers.2.self_attn.q_norm.weight"} <= set(store.manifest.tensors)
    stacks = {t.name: t for t in GGUFReader(path).tensors if "_exps" in t.name}
    for t in stacks.values():  # each expert read on its own, never its whole stack
        inside = [n for off, n in reads if t.data_offset <= off < t.data_offset + t.n_bytes]
        assert inside and set(inside) == {int(t.n_bytes) // 4}, t.name
    for layer in range(3):
        for e in range(4):
            got = _expert_rows(store, layer, e)
            for role, want_t in (("gate", "gate"), ("up", "up"), ("down", "down")):
                t = stacks[f"blk.{layer}.ffn_{want_t}_exps.weight"]
                want = dequantize(t.data, t.tensor_type)[e]  # [out, in]
                if role == "down":
                    want = want.T  # bundle row i is column i of down
                np.testing.assert_allclose(
                    got[f"{role}.weight"].astype(np.float32),
                    want,
                    rtol=0,
                    atol=3e-5,
                    err_msg=f"layer {layer} expert {e} {role}",
                )


@pytest.fixture
def spread_moe(monkeypatch):
    """Qwen3-30B-A3B's routing (128 experts, top-8) over 4 narrow layers (d_model 512, experts of 32)."""
    return reduced(
        monkeypatch,
        "spread-moe",
        "qwen3-30b-a3b",
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        moe_intermediate_size=32,
        intermediate_size=128 * 32,
    )


def _spread(tmp_path, shape, tokenizer, text, gain, monkeypatch) -> list[dict]:
    """routing_spread of a 4-layer file written with attention's norm at `gain`, over 32 tokens of
    `text` fed one at a time after a 64-token prompt (teacher forcing)."""
    import mlx_flash
    from mlx_flash.calibrate.routes import record_teacher_forced, routing_spread
    from mlx_flash.convert import convert

    monkeypatch.setattr(synthetic_gguf, "ATTN_GAIN", gain)
    d = tmp_path / str(gain)
    path = synthetic_gguf.write_synthetic_gguf(
        str(d / "m.gguf"), shape, "Q4_1", layers=4, progress=False, tokenizer=tokenizer
    )
    with mlx_flash.load(convert(path, str(d / "store"), progress=False), backend="torch", progress=False) as e:
        ids = e.tokenizer.encode(text[:4000])[:96]
        return routing_spread(record_teacher_forced(e, ids, 64), 128)


def test_moe_routing_spreads_like_a_trained_models(tmp_path, spread_moe, tokenizer, wiki_text, monkeypatch):
    """Over 32 tokens of held-out text fed one at a time after a 64-token prompt (teacher forcing),
    every layer uses at least 60% of its experts, consecutive tokens share at most 35% of theirs and
    no expert serves more than a third of the tokens."""
    layers = _spread(tmp_path, spread_moe, tokenizer, wiki_text, synthetic_gguf.ATTN_GAIN, monkeypatch)
    print([{k: round(v, 2) for k, v in x.items()} for x in layers])
    for i, x in enumerate(layers):
        assert x["used"] >= 0.6 and x["overlap"] <= 0.35 and x["top"] <= 1 / 3, (i, x)


@pytest.mark.full  # ~7 s: the control of the test above
def test_moe_routing_collapses_with_attention_at_full_gain(tmp_path, spread_moe, tokenizer, wiki_text, monkeypatch):
    """The same file with attention's norm of ones (the generator before): the deepest layer's routing
    collapses past those bounds, so the test above can fail."""
    x = _spread(tmp_path, spread_moe, tokenizer, wiki_text, 1.0, monkeypatch)[-1]
    assert x["used"] < 0.6 or x["overlap"] > 0.35 or x["top"] > 1 / 3, x


def test_moe_logits_match_llama_cpp(tmp_path, small_moe, tokenizer):
    llama_cpp = pytest.importorskip("llama_cpp")
    import mlx_flash
    from mlx_flash.convert import convert

    path = synthetic_gguf.write_synthetic_gguf(
        str(tmp_path / "m.gguf"), small_moe, "Q4_1", seed=3, progress=False, tokenizer=tokenizer
    )
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    ids = llm.tokenize(b"The capital of France is", add_bos=False)
    llm.eval(ids)
    want = np.array(llm.scores[: len(ids)])
    del llm
    with mlx_flash.load(convert(path, str(tmp_path / "store"), progress=False), progress=False) as engine:
        got = np.asarray(engine.logits(ids), np.float32).reshape(len(ids), -1)
    # llama.cpp quantizes activations to 8 bits for its quantized matmuls: about 4% of the logits'
    # spread here. Interleaved RoPE moves them 120%, experts in reverse order 20% (gate and up
    # swapped hardly move them at this scale, where silu is near linear: the test above catches that).
    assert np.abs(got - want).max() < 0.1 * want.std()
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture
def small_k(monkeypatch):
    """A Llama shape whose rows are whole k-quant super-blocks (256): d_model 256, d_ff 512, 4 layers."""
    return reduced(
        monkeypatch,
        "small-k",
        "llama-2-7b",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )


def test_q4_k_m_mixes_types_as_llama_cpp_and_converts_keeping_them(tmp_path, small_k, tokenizer):
    """Q4_K_M: Q4_K everywhere but the output matrix and, in llama.cpp's more-bits layers (here 2
    and 3 of 4), attn_v and ffn_down in Q6_K; weights small and centred; the store keeps each
    tensor's type (the FFN's per layer); logits finite, and llama.cpp's when it is installed."""
    import mlx_flash
    from mlx_flash.convert import convert
    from mlx_flash.store import open_store

    path = synthetic_gguf.write_synthetic_gguf(
        str(tmp_path / "k.gguf"), small_k, "Q4_K_M", seed=2, progress=False, tokenizer=tokenizer
    )
    r = GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in r.tensors if t.tensor_type != GGMLQuantizationType.F32}
    six = {n for n, t in types.items() if t == "Q6_K"}
    assert six == {
        "output.weight",
        "blk.2.attn_v.weight",
        "blk.2.ffn_down.weight",
        "blk.3.attn_v.weight",
        "blk.3.ffn_down.weight",
    }
    assert set(types.values()) == {"Q4_K", "Q6_K"}
    for t in r.tensors:
        if t.tensor_type != GGMLQuantizationType.F32:
            w = dequantize(t.data, t.tensor_type)
            assert np.abs(w).max() <= 0.0251 and 0.008 < w.std() < 0.014 and abs(w.mean()) < 5e-4, t.name
    store = convert(path, str(tmp_path / "store"), progress=False)
    m = open_store(store).manifest
    assert [q["down"].kind for q in m.ffn.layer_quant] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert m.quant["lm_head"].kind == "Q6_K" and m.quant["model.layers.3.self_attn.v_proj"].kind == "Q6_K"
    with mlx_flash.load(store, progress=False) as engine:
        ids = engine.tokenizer.encode("The capital of France is")
        got = np.asarray(engine.logits(ids), np.float32)
    assert np.isfinite(got).all() and 0.05 < got.std() < 10
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    llm.eval(ids)
    want = np.array(llm.scores[: len(ids)])
    del llm
    # llama.cpp quantizes activations to 8 bits for k-quant matmuls (Q8_K): a few % of the spread
    assert np.abs(got - want).max() < 0.1 * want.std()
    assert (got.argmax(-1) == want.argmax(-1)).all()
