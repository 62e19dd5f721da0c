"""How many contexts one KV budget holds, by compression scheme (`python -m mlx_flash.bench kv-capacity`): a
service of a fixed `kv_budget` gets `contexts` calls, each in a new context whose prompt is its own
slice of a corpus; afterwards, how many contexts still hold every chunk in memory (the rest were
swapped out to make room), what the pool's arena holds, and the widths the chunks got."""

from __future__ import annotations

import tempfile
from collections import Counter

from ..service.service import Service


def contexts_held(
    engine,
    ids: list[int],
    budget: int,
    compression: str,
    contexts: int,
    prompt_tokens: int,
    new_tokens: int,
    progress: bool = True,
) -> dict:
    """One scheme's row: contexts wholly in memory after `contexts` calls of `prompt_tokens` tokens of
    ids (context k takes ids[k * prompt_tokens:]) and `new_tokens` generated each."""
    if len(ids) < contexts * prompt_tokens:
        raise ValueError(
            f"{contexts} contexts of {prompt_tokens} tokens need {contexts * prompt_tokens} tokens of text"
        )
    with (
        tempfile.TemporaryDirectory() as d,
        Service(engine, directory=d, kv_budget=budget, kv_compression=compression) as svc,
    ):
        from tqdm import tqdm

        for k in tqdm(range(contexts), desc=f"KV {compression}", unit="context", disable=not progress):
            ctx = svc.new_context()
            prompt = engine.tokenizer.decode(ids[k * prompt_tokens : (k + 1) * prompt_tokens])
            list(svc.call(ctx, prompt, max_tokens=new_tokens))
        s = svc.stats()
        widths = Counter(
            w for c in svc.contexts.values() for w, slot in zip(c.widths, c.table.slots) if slot is not None
        )
        return {
            "compression": compression,
            "contexts_held": s.contexts_resident,
            "contexts": s.contexts,
            "float_slots": s.slots,
            "arena_bytes": s.coded_bytes,
            "arena_used": s.coded_bytes_used,
            "chunk_widths": {str(w or "float32"): n for w, n in sorted(widths.items())},
            "chunks_written": s.chunks_written,
        }
