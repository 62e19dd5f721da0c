"""Two API keys in one service (service/quota.py): one key's contexts never count against, evict or
swap out the other's within its quota, on the real default model; the same runs without a quota
show the other key losing them (so the checks can fail). The server's per-key queue and its fair
start order are in tests/service/test_server.py."""

import pytest

import mlx_flash
from mlx_flash.errors import ConfigError, ContextNotFoundError, MemoryBudgetError
from mlx_flash.service.quota import KeyQuota

pytestmark = pytest.mark.slow
CHUNK = 737280  # bytes of one 16-token chunk of the default model's KV (float32)


def ask(svc, ctx, owner, text="What is the capital of France?"):
    return "".join(s.text for s in svc.call(ctx, [{"role": "user", "content": text}], owner=owner, max_tokens=6))


def test_quota_values_are_checked_and_split_equally():
    assert KeyQuota.among(1, 1024, 16) == KeyQuota()
    q = KeyQuota.among(4, 1024, 16)
    assert (q.contexts, q.kv_share, q.queued) == (256, 0.25, 4)
    assert q.guaranteed_slots(10) == 2
    assert q.may_take("a", "a", 9, 10) and not q.may_take("a", "b", 2, 10) and q.may_take("a", "b", 3, 10)
    for bad in (dict(contexts=0), dict(queued=True), dict(kv_share=0.0), dict(kv_share=1.5)):
        with pytest.raises(ConfigError, match="key quota"):
            KeyQuota(**bad)


@pytest.mark.parametrize("quota", [True, False], ids=["quota", "no-quota"])
def test_one_keys_contexts_never_evict_the_others(engines, store_dir, tmp_path, quota):
    """max_contexts 4, two keys of 2 each: key a making five contexts deletes only its own oldest;
    key b's two stay. Without a quota, a's new contexts delete b's (the least recently used)."""
    engine = engines(store_dir, "torch")
    q = KeyQuota(contexts=2) if quota else KeyQuota()
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget="20MB", max_contexts=4, key_quota=q)
    b = [svc.new_context(owner="b") for _ in range(2)]
    a = [svc.new_context(owner="a") for _ in range(5)]
    kept_b = [c["id"] for c in svc.list(owner="b")]
    if quota:
        assert kept_b == b
        assert [c["id"] for c in svc.list(owner="a")] == a[-2:]
        with pytest.raises(ContextNotFoundError):
            svc.get(a[0], owner="a")
    else:
        assert kept_b == []
    svc.close()


@pytest.mark.parametrize("quota", [True, False], ids=["quota", "no-quota"])
def test_one_keys_calls_never_swap_out_the_others_share(engines, store_dir, tmp_path, quota):
    """A pool of 8 chunks, two keys guaranteed 4 each: key b holds a 3-chunk context, then key a calls
    in three new contexts (3 chunks each, more than the pool holds): a's chunks go to flash, b's stay
    in memory and its next call reads nothing back. Without a quota, b's are the first to go."""
    engine = engines(store_dir, "torch")
    q = KeyQuota(kv_share=0.5) if quota else KeyQuota()
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget=8 * CHUNK, key_quota=q)
    kb = svc.new_context(owner="b")
    ask(svc, kb, "b")
    held_b = len(svc.get(kb, "b").chunks_in_memory())
    assert held_b == 3
    for _ in range(3):
        ask(svc, svc.new_context(owner="a"), "a")
    assert svc.stats().chunks_written > 0  # the pool was full: chunks went to flash
    if quota:
        assert len(svc.get(kb, "b").chunks_in_memory()) == held_b
        ask(svc, kb, "b", "And of Italy?")
        assert svc.last.restore.chunks_read == 0 and svc.last.restore.chunks_recomputed == 0
    else:
        assert len(svc.get(kb, "b").chunks_in_memory()) < held_b
    svc.close()


def test_a_key_at_its_share_with_every_chunk_in_use_is_refused_not_served_from_the_other(engines, store_dir, tmp_path):
    """A pool of 4 chunks, two keys guaranteed 2 each: b's context holds 3 (one over its share: a may
    take that one back), a's call needs 3: b keeps its guaranteed 2, a's call that needs more than
    the rest is refused with the KV budget error, and b still answers from memory."""
    engine = engines(store_dir, "torch")
    svc = mlx_flash.Service(engine, directory=str(tmp_path), kv_budget=4 * CHUNK, key_quota=KeyQuota(kv_share=0.5))
    kb = svc.new_context(owner="b")
    ask(svc, kb, "b")
    assert len(svc.get(kb, "b").chunks_in_memory()) == 3
    ka = svc.new_context(owner="a")
    with pytest.raises(MemoryBudgetError, match="KV budget"):
        ask(svc, ka, "a", "What is the capital of France? Answer in one short sentence please.")
    assert len(svc.get(kb, "b").chunks_in_memory()) >= 2
    svc.close()
