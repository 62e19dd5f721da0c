"""One app's context as the service holds it: its tokens, chat messages, chunk table and the state
of each chunk's swap file; and its record on flash (what survives a restart)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .chunked_kv import ChunkTable

RECORD_VERSION = 2


@dataclass
class Context:
    id: str
    owner: str  # a digest of the API key that created it ("" without keys): contexts are scoped by it
    table: ChunkTable
    sequence: list[int] = field(default_factory=list)  # every token of the context; KV holds the first table.tokens
    messages: list[dict] = field(default_factory=list)  # the chat so far (calls with messages)
    disk: list[int | None] = field(default_factory=list)  # per chunk: crc32 of its current swap file, or None
    widths: list[int] = field(default_factory=list)  # per chunk: bits it was compressed to (0: not compressed)
    last_used: float = field(default_factory=time.monotonic)
    pinned: bool = False  # a call is running on it: never evicted

    @property
    def kv_tokens(self) -> int:
        return self.table.tokens

    def held(self) -> list[int]:
        """The tokens whose KV the context holds (in memory or on flash)."""
        return self.sequence[: self.table.tokens]

    def chunks_in_memory(self) -> list[int]:
        return [i for i, s in enumerate(self.table.slots) if s is not None]

    def mark_changed(self, first_token: int) -> None:
        """Tokens from first_token on were rewritten: the swap files of their chunks are stale."""
        C = self.table.chunk_tokens
        n = self.table.chunks_for(self.table.tokens)
        self.disk = (self.disk + [None] * n)[:n]
        self.widths = (self.widths + [0] * n)[:n]
        for i in range(first_token // C, n):
            self.disk[i] = None
            self.widths[i] = 0
        if self.table.density is not None:
            self.table.density.truncate(self.table.tokens)

    def chunk_tokens(self, i: int) -> int:
        """Tokens chunk i holds."""
        C = self.table.chunk_tokens
        return max(0, min(C, self.table.tokens - i * C))

    def record(self, model: str) -> dict:
        return {
            "version": RECORD_VERSION,
            "id": self.id,
            "owner": self.owner,
            "model": model,
            "kv_tokens": self.table.tokens,
            "sequence": self.sequence,
            "messages": self.messages,
            "disk": self.disk,
            "widths": self.widths,
        }

    @classmethod
    def from_record(cls, rec: dict, table: ChunkTable, model: str) -> "Context":
        """A context read back at start: every chunk on flash (or to recompute). Raises ValueError
        for a record of another model or version, or one whose fields do not agree."""
        if rec.get("version") != RECORD_VERSION:
            raise ValueError(f"record version {rec.get('version')!r} is not {RECORD_VERSION}")
        if rec.get("model") != model:
            raise ValueError("it was made with another model")
        seq, kv, disk, widths = rec.get("sequence"), rec.get("kv_tokens"), rec.get("disk"), rec.get("widths")
        if not (
            isinstance(seq, list)
            and all(isinstance(t, int) for t in seq)
            and isinstance(kv, int)
            and 0 <= kv <= len(seq)
            and isinstance(disk, list)
            and all(c is None or isinstance(c, int) for c in disk)
            and isinstance(widths, list)
            and all(w in (0, 2, 4, 8) for w in widths)
        ):
            raise ValueError("its tokens, KV length or chunk list are malformed")
        msgs = rec.get("messages") or []
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("its messages are malformed")
        n = table.chunks_for(kv)
        table.slots = [None] * n
        table.tokens = kv
        ctx = cls(
            id=rec["id"],
            owner=str(rec.get("owner", "")),
            table=table,
            sequence=list(seq),
            messages=msgs,
            disk=(list(disk) + [None] * n)[:n],
            widths=(list(widths) + [0] * n)[:n],
        )
        return ctx
