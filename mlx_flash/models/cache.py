"""Per-layer KV cache, passed explicitly to the graph (one object per layer).

Keys/values live in a preallocated buffer grown in steps of `step` tokens, so decode appends
without reallocating every token, never past `max_tokens` (what the memory plan holds KV for).
"""

from __future__ import annotations


class KVCache:
    step = 256

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens
        self.keys = None
        self.values = None
        self.offset = 0

    def update(self, ops, k, v):
        """Append k, v [B, Hkv, T, hd]; return all cached keys and values [B, Hkv, offset, hd]."""
        B, H, T, D = k.shape
        end = self.offset + T
        if self.keys is None or end > self.keys.shape[2]:
            cap = -(-end // self.step) * self.step
            if self.max_tokens:
                cap = max(end, min(cap, self.max_tokens))
            nk, nv = ops.zeros((B, H, cap, D), like=k), ops.zeros((B, H, cap, v.shape[3]), like=v)
            if self.keys is not None:
                nk[:, :, : self.offset, :] = self.keys[:, :, : self.offset, :]
                nv[:, :, : self.offset, :] = self.values[:, :, : self.offset, :]
            self.keys, self.values = nk, nv
        self.keys[:, :, self.offset:end, :] = k
        self.values[:, :, self.offset:end, :] = v
        self.offset = end
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]

    def trim(self, n: int) -> None:
        """Forget the last n tokens (rejected speculative tokens); their slots are overwritten later."""
        if not 0 <= n <= self.offset:
            raise ValueError(f"cannot trim {n} tokens from a cache of {self.offset}")
        self.offset -= n


def make_caches(n_layers: int, max_tokens: int | None = None) -> list[KVCache]:
    return [KVCache(max_tokens) for _ in range(n_layers)]
