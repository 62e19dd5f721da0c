"""Finding a context: by id under its owner (owned), and by the tokens it shares with a call
(common_prefix: a call keeps the KV of the longest common prefix; Service.match and the distributed
conversations pick a context by it)."""

from __future__ import annotations

from ..errors import ContextNotFoundError


def owned(contexts: dict, ctx_id: str, owner: str):
    """The context of that id if `owner` owns it; another owner's is as unknown as a missing one."""
    ctx = contexts.get(ctx_id) if isinstance(ctx_id, str) else None
    if ctx is None or ctx.owner != owner:
        raise ContextNotFoundError(f"no context with id {str(ctx_id)[:80]!r}")
    return ctx


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
