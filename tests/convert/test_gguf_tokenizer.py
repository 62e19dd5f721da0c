"""The tokenizer rebuilt from the default model's GGUF metadata with `tokenizers` alone is the one
transformers' GGUF loader builds: same tokenizer.json, same ids, same text, same chat prompt."""

import json
import os

import pytest

from mlx_flash.errors import ModelFileError
from mlx_flash.convert.gguf_tokenizer import byte_alphabet, save_gguf_tokenizer
from mlx_flash.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is",
    "  leading spaces, trailing   \n\n\ttabs and\r\nnewlines  ",
    "Numbers 1234567 and 3.14159, dates 2024-11-22; code: def f(x): return x**2",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂👍🏽, ZWJ 👩‍💻",
    "special tokens inside text: <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name 3 colors 🙂"},
    ],
]


@pytest.fixture(scope="module")
def ours(default_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_gguf_tokenizer(default_gguf, str(out))
    return str(out)


@pytest.fixture(scope="module")
def reference(default_gguf):
    pytest.importorskip("torch")  # transformers' GGUF reader needs torch
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf)
    )


def test_byte_alphabet_is_a_bijection_of_printable_characters():
    spelled = byte_alphabet()
    assert len(set(spelled.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in spelled.values())
    assert spelled[ord("A")] == "A" and spelled[ord(" ")] == "Ġ"


def test_writes_tokenizer_and_config(ours):
    with open(os.path.join(ours, "tokenizer_config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["eos_token"] == "<|im_end|>" and cfg["add_bos_token"] is False
    assert "<|im_start|>assistant" in cfg["chat_template"]
    tok = Tokenizer(ours)
    assert tok.eos_token_ids == {2}


@pytest.mark.slow
def test_same_tokenizer_json_as_transformers(ours, reference, tmp_path):
    reference.save_pretrained(str(tmp_path))
    with open(tmp_path / "tokenizer.json") as a, open(os.path.join(ours, "tokenizer.json")) as b:
        assert json.load(a) == json.load(b)


@pytest.mark.slow
def test_same_ids_text_and_chat_prompt_as_transformers(ours, reference, wiki_text):
    tok = Tokenizer(ours)
    for text in TEXTS + [wiki_text[:20000]]:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text[:40]
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=False)
    for chat in CHATS:
        ref = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "input_ids") else ref
        assert tok.apply_chat_template(chat) == list(ref)


def test_gguf_without_vocabulary_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "novocab.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="no tokenizer.ggml.tokens"):
        save_gguf_tokenizer(path, str(tmp_path))


def test_a_vocabulary_needing_transformers_is_refused_before_any_conversion(tmp_path, monkeypatch):
    """Without transformers a unigram vocabulary cannot be built: read_gguf refuses it at once,
    naming the install line, instead of after the tensors are written (sentencepiece ones are built
    without it: test_gguf_sentencepiece.py)."""
    import importlib.util

    from mlx_flash.convert.gguf_source import read_gguf

    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "unigram.gguf")
    w = gguf.GGUFWriter(path, "t5")
    w.add_tokenizer_model("t5")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a))
    with pytest.raises(ModelFileError, match=r"a 't5' vocabulary of a 't5' model .* needs transformers, which is not"):
        read_gguf(path)
