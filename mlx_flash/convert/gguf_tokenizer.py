"""Build a store's tokenizer files from a GGUF file's metadata, once, at conversion.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, merges, token types, special token ids
and chat template under llama.cpp's `tokenizer.ggml.*` keys. We read them with the `gguf` reader and
assemble the tokenizer with the `tokenizers` library (no hand-written BPE), writing
`tokenizer.json` + `tokenizer_config.json` (special tokens, BOS/EOS flags, chat template). At run
time `mlx_flash.tokenizer` loads those with `tokenizers` and `jinja2` alone, so neither conversion
nor generation needs transformers or torch.

Byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`: SmolLM, Llama 3, Qwen, GPT-style
models) are built here, sentencepiece ones ("llama": Llama 2, Mistral, Gemma) in gguf_sentencepiece.py,
each the same tokenizer transformers' GGUF loader builds (tested against it). Other vocabulary types
(unigram "t5", sentencepiece of families not built there) go through transformers when it is
installed; without it they are refused with the install line.
"""

from __future__ import annotations

import os

from ..durable import write_json, write_new
from ..errors import ModelFileError
from ..store.atomic_dir import OutputError
from .gguf_header import GGUFField, read_gguf_header
from .gguf_sentencepiece import BUILT as SENTENCEPIECE_BUILT
from .gguf_sentencepiece import sentencepiece_bpe

# Token types in `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4

# Split rules of pre-tokenizer names (`tokenizer.ggml.pre`) whose text splitting differs from GPT-2's.
# Names not listed split like GPT-2 (the ByteLevel pre-tokenizer's own rule), as transformers does.
_LLAMA3_RULE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RULE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_RULES = {
    "llama3": _LLAMA3_RULE,
    "llama-v3": _LLAMA3_RULE,
    "llama-bpe": _LLAMA3_RULE,
    "falcon3": _LLAMA3_RULE,
    "smaug-bpe": _LLAMA3_RULE,
    "dbrx": _LLAMA3_RULE,
    "qwen2": _QWEN2_RULE,
    "deepseek-r1-qwen": _QWEN2_RULE,
}

INSTALL_HF = "pip install transformers sentencepiece torch==2.13.0"


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values (the alphabet byte-level vocabularies use)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def tokenizer_fields(path: str, why: str = "no vocabulary to build a tokenizer from") -> dict[str, GGUFField]:
    """The `tokenizer.*` and `general.architecture` fields of a GGUF (values and their GGUF types); a
    file without a vocabulary is refused, saying `why` it is needed."""
    fields = read_gguf_header(path).fields
    fields = {k: f for k, f in fields.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    if "tokenizer.ggml.tokens" not in fields:
        raise ModelFileError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens ({why})")
    return fields


def read_tokenizer_metadata(path: str) -> dict:
    """The `tokenizer.*` and `general.architecture` fields of a GGUF as plain Python values."""
    meta = {k: f.value for k, f in tokenizer_fields(path).items()}
    for key, ok, what in _TYPES:
        if f"tokenizer.ggml.{key}" in meta and not ok(meta[f"tokenizer.ggml.{key}"]):
            raise ModelFileError(
                f"{path}: GGUF metadata tokenizer.ggml.{key} = "
                f"{str(meta[f'tokenizer.ggml.{key}'])[:40]!r} is not {what}"
            )
    if not meta["tokenizer.ggml.tokens"]:
        raise ModelFileError(f"{path}: GGUF metadata tokenizer.ggml.tokens is empty")
    return meta


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _list_of(kind):
    return lambda v: isinstance(v, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in v)


# What the builders below compute with: metadata read as whatever type the file says is checked
# against these first, so a mangled file is one named error, not a TypeError deep in the build.
_TYPES = (
    ("tokens", _list_of(str), "a list of strings"),
    ("merges", _list_of(str), "a list of strings"),
    ("token_type", _list_of(int), "a list of integers"),
    ("model", lambda v: isinstance(v, str), "a string"),
    ("pre", lambda v: isinstance(v, str), "a string"),
    *(
        (f"{k}_token_id", lambda v: _int(v) and 0 <= v < 1 << 32, "a token id")
        for k in ("bos", "eos", "unknown", "padding")
    ),
)


def _special(meta: dict, key: str) -> str | None:
    idx = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: special tokens, whether BOS/EOS are added, the chat template."""
    cfg = {
        "bos_token": _special(meta, "bos_token_id"),
        "eos_token": _special(meta, "eos_token_id"),
        "unk_token": _special(meta, "unknown_token_id"),
        "pad_token": _special(meta, "padding_token_id"),
        # (llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise)
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    if meta.get("tokenizer.chat_template"):
        cfg["chat_template"] = str(meta["tokenizer.chat_template"])
    return cfg


def byte_level_bpe(meta: dict, path: str):
    """A `tokenizers.Tokenizer` for a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelFileError(f"{path}: byte-level BPE vocabulary without tokenizer.ggml.merges")
    spelled = byte_alphabet()
    alphabet = set(spelled.values())
    # Regular tokens are written in the byte alphabet; a token spelled otherwise (a control token
    # like <|im_end|> is fine either way) is respelled so its bytes map into the alphabet.
    vocab = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= alphabet else "".join(spelled[b] for b in t.encode("utf-8"))
        vocab[key] = i  # a repeated spelling keeps its last id, as llama.cpp does
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelFileError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    try:
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=pairs,
                dropout=None,
                unk_token=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
            )
        )
    except Exception as e:  # the Rust library raises its own exception type (a merge of unknown tokens)
        raise ModelFileError(
            f"{path}: tokenizer.ggml vocabulary and merges do not make a BPE tokenizer ({str(e).splitlines()[0][:100]})"
        ) from None
    rule = SPLIT_RULES.get(str(meta.get("tokenizer.ggml.pre", "")))
    if rule is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(rule), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return finish(tok, meta, vocab, lambda t: set(t) <= alphabet)


def finish(tok, meta: dict, vocab: dict, spelled_ok=lambda t: True, named: bool = False):
    """Add what the file marks: control tokens (and with `named`, the BOS/EOS/UNK/PAD tokens) as
    special tokens kept whole, user-defined ones as plain added tokens, BOS/EOS around a sequence
    where the file asks for them. `spelled_ok`: a control token spelled outside the vocabulary's
    alphabet is a mislabel, left out (adding it would grow the vocabulary past the model's)."""
    from tokenizers import AddedToken, processors

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL and spelled_ok(t)]
    cfg = tokenizer_config(meta)
    if named:
        control += [
            cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if cfg[k] and cfg[k] not in control
        ]
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    single, specials = "$A", []
    if cfg["add_bos_token"] and cfg["bos_token"] is not None:
        single = f"{cfg['bos_token']} {single}"
        specials.append((cfg["bos_token"], vocab.get(cfg["bos_token"], int(meta["tokenizer.ggml.bos_token_id"]))))
    if cfg["add_eos_token"] and cfg["eos_token"] is not None:
        single = f"{single} {cfg['eos_token']}"
        specials.append((cfg["eos_token"], vocab.get(cfg["eos_token"], int(meta["tokenizer.ggml.eos_token_id"]))))
    tok.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} $B:1", special_tokens=specials)
    return tok


def save_through_transformers(path: str, out_dir: str, why: str, directory: str, **load_kwargs) -> None:
    """Tokenizers this package does not build itself (sentencepiece or unigram vocabularies): loaded
    with transformers from `directory` (+ `load_kwargs`), if installed, and saved as tokenizer.json
    once, at conversion. Errors name `path` and say `why` transformers was needed."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ModelFileError(f"{path}: {why} needs transformers, which is not installed ({INSTALL_HF})") from None
    try:
        tok = AutoTokenizer.from_pretrained(directory, **load_kwargs)
    except Exception as e:  # transformers raises many types for odd vocabularies
        raise ModelFileError(f"{path}: cannot build its tokenizer through transformers ({e})") from None
    tok.save_pretrained(out_dir)  # (library files in a folder written whole: sync_tree makes them durable)


def builds_without_transformers(kind: str, arch: str) -> bool:
    """Vocabularies built here: byte-level BPE, and sentencepiece of the families gguf_sentencepiece knows."""
    return kind == "gpt2" or (kind == "llama" and arch in SENTENCEPIECE_BUILT)


def check_vocabulary_buildable(path: str, kind: str, arch: str = "") -> None:
    """Refuse, before any conversion work, a vocabulary of `kind` (tokenizer.ggml.model) that needs
    transformers when it is not installed: the message save_gguf_tokenizer would give at its end."""
    import importlib.util

    if kind and not builds_without_transformers(kind, arch) and importlib.util.find_spec("transformers") is None:
        raise ModelFileError(f"{path}: {_why(kind, arch)} needs transformers, which is not installed ({INSTALL_HF})")


def _why(kind: str, arch: str) -> str:
    return (
        f"a {kind!r} vocabulary of a {arch or 'unnamed'!r} model (built without it: byte-level BPE, and "
        f"sentencepiece of {', '.join(SENTENCEPIECE_BUILT)})"
    )


def save_gguf_tokenizer(path: str, out_dir: str) -> None:
    """Write tokenizer.json + tokenizer_config.json for the GGUF at `path` into `out_dir`."""
    meta = read_tokenizer_metadata(path)
    kind = str(meta.get("tokenizer.ggml.model", ""))
    arch = str(meta.get("general.architecture", ""))
    if kind == "gpt2":
        tok = byte_level_bpe(meta, path)
    elif builds_without_transformers(kind, arch):
        tok = sentencepiece_bpe(meta, path, arch)
        tok = finish(tok, meta, tok.get_vocab(), named=True)
    else:
        save_through_transformers(
            path, out_dir, _why(kind, arch), os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
        )
        return
    # (into the folder of a store or model directory being written whole: FolderFile's)
    write_new(os.path.join(out_dir, "tokenizer.json"), [tok.to_str(pretty=True).encode()], OutputError)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config(meta), OutputError, 2, in_folder=True)
