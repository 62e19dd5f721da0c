"""What one API key may hold in a service shared by several (the server's keys; a context's `owner`).

Contexts are already private to the key that made them (lookup.owned: another key's context is as
unknown as a missing one, to list, read, call or delete). A quota keeps one key from taking what
another holds:

  contexts  contexts one key keeps: at it, that key's own least recently used idle context is
            deleted to make room; the service's max_contexts then deletes another key's context
            only while that key holds more than its quota
  kv_share  the share of the KV pool each key is guaranteed: when the pool is full, a key's chunks
            move to flash for another key only while that key holds more than its share in memory
            (a key may use more while others are idle; its excess is what goes first)
  queued    requests one key may have waiting for the engine (the server answers more with 429),
            and the server starts waiting requests from the key with the fewest running first

`KeyQuota.among(n, ...)` splits the service's limits equally between n keys, so that no key's
use can evict, swap out or starve another's; `KeyQuota()` (one key, or none) sets no quota.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class KeyQuota:
    contexts: int | None = None  # None: only the service's max_contexts
    kv_share: float = 1.0  # 1.0: no guarantee (the pool's least recently used chunks go first, any key's)
    queued: int | None = None  # None: only the server's queue limit

    def __post_init__(self):
        for name in ("contexts", "queued"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"key quota {name} must be an integer >= 1 or None (got {v!r})")
        if not isinstance(self.kv_share, (int, float)) or not 0.0 < self.kv_share <= 1.0:
            raise ConfigError(f"key quota kv_share must be in (0, 1] (got {self.kv_share!r})")

    @classmethod
    def among(cls, keys: int, max_contexts: int, queue_limit: int) -> "KeyQuota":
        """Equal shares for `keys` keys (none for one key)."""
        if keys <= 1:
            return cls()
        return cls(max(1, max_contexts // keys), 1.0 / keys, max(1, queue_limit // keys))

    def guaranteed_slots(self, n_slots: int) -> int:
        """Chunk slots of a pool of n_slots no other key can move out of memory."""
        return int(self.kv_share * n_slots + 1e-9)

    def may_take(self, taker: str, holder: str, held: int, n_slots: int) -> bool:
        """Whether `taker` may move a chunk of `holder` (who holds `held` slots in memory) out."""
        return self.kv_share >= 1.0 or taker == holder or held > self.guaranteed_slots(n_slots)

    def over_contexts(self, held: int) -> bool:
        """Whether a key holding `held` contexts holds more than its quota."""
        return self.contexts is not None and held > self.contexts
