"""Tokenizer and chat template, loaded from the store through mlx-lm's tokenizer wrapper
(transformers underneath; it also picks the right streaming detokenizer)."""

from __future__ import annotations

from pathlib import Path

from .errors import ModelFileError


class Tokenizer:
    def __init__(self, store_path: str, eos_token_ids=None):
        from mlx_lm.tokenizer_utils import load

        try:
            self._tok = load(Path(store_path), eos_token_ids=eos_token_ids)
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{store_path}: cannot load the tokenizer ({e})") from None
        self.eos_token_ids = set(self._tok.eos_token_ids or [])

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The model's own template with the assistant turn opened."""
        if not self.has_chat_template:
            raise ModelFileError("this model's tokenizer has no chat template; pass a plain string prompt")
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def detokenizer(self, context: list[int] | None = None) -> "StreamDecoder":
        return StreamDecoder(self, context or [])


class StreamDecoder:
    """Incremental text of generated tokens, exactly as decode(context + generated) continues
    decode(context): the last few prompt tokens give the leading space / byte-fallback context.
    Text ending in an incomplete UTF-8 character is held back until the character completes."""

    CONTEXT = 4

    def __init__(self, tok: Tokenizer, context: list[int]):
        self.tok = tok
        self.context = list(context[-self.CONTEXT:])
        self.base = tok.decode(self.context) if self.context else ""
        self.ids: list[int] = []
        self.text = ""

    def add_token(self, token: int) -> str:
        """Append a token; return the newly completed text (possibly "")."""
        self.ids.append(token)
        full = self.tok.decode(self.context + self.ids)
        full = full[len(self.base):] if full.startswith(self.base) else full
        if full.endswith("\ufffd"):
            return ""
        new = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return new

    def finalize(self) -> str:
        """Flush whatever is held back (an incomplete character decodes as U+FFFD)."""
        full = self.tok.decode(self.context + self.ids)
        full = full[len(self.base):] if full.startswith(self.base) else full
        new = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return new
