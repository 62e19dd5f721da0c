"""The OpenAI wire format: requests checked into typed values, responses and errors built.

Every check names the field and what is wrong in one line (ApiError, with its HTTP status); the
server turns it into OpenAI's error object. Fields OpenAI defines that this engine does not
implement are accepted only at their neutral value (n=1, penalties 0, no logprobs); a field
nobody defines is refused, so a typo is never silently ignored.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Sampling:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def kwargs(self) -> dict:
        return dict(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
        )


@dataclass
class Request:
    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    prompt: object  # list of {"role", "content"} or a str
    model: str | None
    stream: bool
    include_usage: bool
    sampling: Sampling
    context_id: str | None
    max_tokens_field: str | None = None  # the field that set sampling.max_tokens (None: the server's default)


_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "context_id",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    "logit_bias",
}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
ROLES = ("system", "user", "assistant")


def parse_request(body, chat: bool, max_tokens_default: int = 256) -> Request:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}", unknown[0])
    _neutral(body, "n", 1)
    _neutral(body, "frequency_penalty", 0)
    _neutral(body, "presence_penalty", 0)
    _neutral(body, "logprobs", None, False)
    _neutral(body, "logit_bias", None, {})
    _neutral(body, "echo", False)
    _neutral(body, "suffix", None)
    _neutral(body, "best_of", 1)
    _neutral(body, "top_logprobs", None, 0)
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only {'type': 'text'} is supported", "response_format")
    if chat:
        prompt = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", "prompt")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    limit = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    s = Sampling(
        max_tokens=max_tokens_default if limit is None else _int(limit, name, 0),
        temperature=_number(body.get("temperature", 1.0), "temperature", 0.0, 2.0),
        top_p=_number(body.get("top_p", 1.0), "top_p", 0.0, 1.0),
        top_k=_int(body.get("top_k", 0), "top_k", 0),
        seed=None if body.get("seed") is None else _int(body["seed"], "seed", 0),
        stop=_stop(body.get("stop")),
    )
    if s.top_p == 0:
        raise ApiError(400, "top_p must be more than 0", "top_p")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise ApiError(400, "stream_options takes only include_usage", "stream_options")
    ctx = body.get("context_id")
    if ctx is not None and not isinstance(ctx, str):
        raise ApiError(400, "context_id must be a string", "context_id")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "user must be a string", "user")
    return Request(
        chat, prompt, model, stream, bool(opts.get("include_usage", True)), s, ctx, None if limit is None else name
    )


def check_max_tokens(req: Request, model_context: int) -> None:
    """A max_tokens no answer of this model can reach is refused by name (one within the context that
    the prompt leaves no room for is cut there instead: finish_reason "length")."""
    n = req.sampling.max_tokens
    if req.max_tokens_field is not None and n > model_context:
        raise ApiError(
            400,
            f"{req.max_tokens_field} {n} is more than the model's context ({model_context} tokens)",
            req.max_tokens_field,
        )


def _neutral(body: dict, name: str, *neutral) -> None:
    if name in body and body[name] not in neutral:
        raise ApiError(400, f"{name} {body[name]!r} is not supported (only {neutral[0]!r})", name)


def _int(v, name: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer (got {v!r})", name)
    if v < lo:
        raise ApiError(400, f"{name} must be >= {lo} (got {v})", name)
    return v


def _number(v, name: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"{name} must be a number (got {v!r})", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"{name} must be between {lo:g} and {hi:g} (got {v})", name)
    return float(v)


def _stop(v) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and len(v) <= 4 and all(isinstance(s, str) for s in v):
        return v
    raise ApiError(400, "stop must be a string or a list of at most 4 strings", "stop")


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] needs a role among {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


# ---- responses -------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion(req: Request, rid: str, model: str, text: str, finish: str | None, use: dict) -> dict:
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk(
    req: Request,
    rid: str,
    model: str,
    text: str | None,
    finish: str | None,
    first: bool = False,
    use: dict | None = None,
) -> dict:
    if use is not None:
        choices = []
    elif req.chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
        choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    out = {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    return out
