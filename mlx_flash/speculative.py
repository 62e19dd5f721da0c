"""Prompt-lookup drafting for speculative decoding (LLM in a flash §5.2 pairs it with windowing):
the draft for the next tokens is what followed the most recent earlier occurrence of the last n
tokens in the context. No second model is needed; the verifier runs the last token plus the draft in
one forward pass and keeps the longest prefix its own greedy choice agrees with."""

from __future__ import annotations


def ngram_draft(context: list[int], lam: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to `lam` tokens that followed the latest earlier match of the context's last n tokens
    (longest n first); [] when nothing matches."""
    if lam <= 0:
        return []
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = context[L - n :]
        for s in range(L - n - 1, -1, -1):  # latest match first, never the tail itself
            if context[s : s + n] == tail:
                return list(context[s + n : s + n + lam])
    return []


def accepted_prefix(draft: list[int], greedy: list[int]) -> int:
    """How many draft tokens the verifier's greedy picks confirm: greedy[j] is its choice after
    the last token and draft[:j]."""
    a = 0
    while a < len(draft) and greedy[a] == draft[a]:
        a += 1
    return a
