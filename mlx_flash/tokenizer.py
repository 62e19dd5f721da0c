"""Tokenizer and chat template of a store, loaded with `tokenizers` and `jinja2` alone.

A store holds `tokenizer.json` (the `tokenizers` library's format) and `tokenizer_config.json`
(special tokens, the chat template), written at conversion (`convert/gguf_tokenizer.py` for GGUF
sources, copied for HF directories). Nothing here imports transformers or torch: a process on the
MLX backend never pays for them. The chat template is rendered as the transformers convention does
(sandboxed jinja2, trim_blocks/lstrip_blocks, `raise_exception`, a JSON `tojson`), and the rendered
text is encoded without adding special tokens, as transformers does.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from .errors import ModelFileError


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return data


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template_of(store_path: str, config: dict) -> str | None:
    """The template from tokenizer_config.json, or chat_template.jinja / chat_template.json beside it.
    A list of named templates picks "default"."""
    template = config.get("chat_template")
    jinja_file = os.path.join(store_path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as fh:
            template = fh.read()
    if template is None:
        template = _read_json(os.path.join(store_path, "chat_template.json")).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def compile_template(source: str):
    """A sandboxed jinja2 template with the helpers chat templates expect."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters, which would change the prompt's text
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelFileError(f"chat template: {e} (line {e.lineno})") from None


class Tokenizer:
    def __init__(self, store_path: str, eos_token_ids=None):
        from tokenizers import Tokenizer as Backend

        path = os.path.join(store_path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelFileError(f"{store_path}: no tokenizer.json (convert the model again to write one)")
        try:
            self._tok = Backend.from_file(path)
        except Exception as e:  # the Rust library raises its own exception type for bad files
            raise ModelFileError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
        config = _read_json(os.path.join(store_path, "tokenizer_config.json"))
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.chat_template = chat_template_of(store_path, config)
        self._template = None
        if eos_token_ids is None:
            eos = self.special["eos_token"]
            eos_id = self._tok.token_to_id(eos) if eos is not None else None
            eos_token_ids = [] if eos_id is None else [eos_id]
        self.eos_token_ids = set(eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text of `messages` through the model's template, the assistant turn opened."""
        if not self.has_chat_template:
            raise ModelFileError("this model's tokenizer has no chat template; pass a plain string prompt")
        import jinja2

        if self._template is None:
            self._template = compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                **{k: v for k, v in self.special.items() if v is not None},
            )
        except jinja2.exceptions.TemplateError as e:
            raise ModelFileError(f"chat template: {e}") from None

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered chat; the template writes any special tokens itself."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def detokenizer(self, context: list[int] | None = None) -> "StreamDecoder":
        return StreamDecoder(self, context or [])


class StreamDecoder:
    """Incremental text of generated tokens, exactly as decode(context + generated) continues
    decode(context): the last few prompt tokens give the leading space / byte-fallback context.
    Text ending in an incomplete UTF-8 character is held back until the character completes."""

    CONTEXT = 4

    def __init__(self, tok: Tokenizer, context: list[int]):
        self.tok = tok
        self.context = list(context[-self.CONTEXT :])
        self.base = tok.decode(self.context) if self.context else ""
        self.ids: list[int] = []
        self.text = ""

    def add_token(self, token: int) -> str:
        """Append a token; return the newly completed text (possibly "")."""
        self.ids.append(token)
        full = self.tok.decode(self.context + self.ids)
        full = full[len(self.base) :] if full.startswith(self.base) else full
        if full.endswith("\ufffd"):
            return ""
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return new

    def finalize(self) -> str:
        """Flush whatever is held back (an incomplete character decodes as U+FFFD)."""
        full = self.tok.decode(self.context + self.ids)
        full = full[len(self.base) :] if full.startswith(self.base) else full
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return new
