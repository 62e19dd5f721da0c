"""Sentencepiece vocabularies of GGUF files (`tokenizer.ggml.model = "llama"`: Llama 1 and 2, Mistral
v0.1, Gemma 1-3, ...) built with `tokenizers` alone: a BPE with byte fallback over the file's own
spelling of the pieces ("\u2581" for a space), so conversion needs neither transformers nor the
sentencepiece package. The result is the tokenizer transformers' GGUF loader builds for the same file
(tests/convert/test_gguf_sentencepiece.py compares ids and text, on a synthetic Llama-style
vocabulary and on the Gemma 3 270M file).

Files rarely carry `tokenizer.ggml.merges` for these vocabularies; the merges are then recovered
from the vocabulary: every split of a piece into two pieces is a merge, ranked by the piece's score
(`tokenizer.ggml.scores`, highest first). Gemma's files differ in two ways: a piece made of several
spaces is stored with real spaces (respelled "\u2581..." so merges built from it match the
normalized text), and its scores do not follow its merge order while the order of the pieces in the
file does, so the rank is the position. Text is cut as each family's reference tokenizer cuts it:
Llama-style vocabularies prefix the first word with "\u2581" (Metaspace; `tokenizer.ggml.add_space_prefix`
false turns that off), Gemma's replace spaces and add no prefix.
"""

from __future__ import annotations

from ..errors import ModelFileError

SPACE = "\u2581"
GEMMA = ("gemma", "gemma2", "gemma3")  # general.architecture values built the Gemma way
BUILT = ("llama",) + GEMMA  # the sentencepiece families built here; others go through transformers


def sentencepiece_bpe(meta: dict, path: str, arch: str):
    """A `tokenizers.Tokenizer` for a sentencepiece GGUF vocabulary of architecture `arch` in BUILT."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    gemma = arch in GEMMA
    tokens = list(meta["tokenizer.ggml.tokens"])
    if gemma:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated piece keeps its last id
    merges = _merges(meta, tokens, vocab, gemma, path)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    try:
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                unk_token=tokens[unk] if gemma and unk is not None and unk < len(tokens) else None,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
    except Exception as e:  # the Rust library raises its own exception type
        raise ModelFileError(
            f"{path}: tokenizer.ggml vocabulary does not make a BPE tokenizer ({str(e).splitlines()[0][:100]})"
        ) from None
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges(meta: dict, tokens: list[str], vocab: dict, gemma: bool, path: str) -> list[tuple[str, str]]:
    """The file's merges, or those its vocabulary implies (see the module docstring)."""
    if meta.get("tokenizer.ggml.merges"):
        out = []
        for m in meta["tokenizer.ggml.merges"]:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ModelFileError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
            out.append((a, b))
        return out
    if gemma:
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ModelFileError(f"{path}: a sentencepiece vocabulary without merges needs tokenizer.ggml.scores")
        rank = dict(zip(tokens, (float(s) for s in scores)))
    found = []
    for piece, score in rank.items():
        splits = [
            (piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
        ]
        splits.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(splits)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep the order above
    return [(a, b) for a, b, _ in found]
