"""Expert-cache policies: Belady is optimal on random traces, each online policy evicts what its
definition says, and the slot cache's bookkeeping stays consistent."""

import numpy as np
import pytest

from mlx_flash.moe.expert_cache import ExpertCache
from mlx_flash.moe.policies import EdgeMoE, LFU, LRU, POLICIES, simulate


def random_trace(steps=200, layers=4, experts=8, k=2, seed=0):
    rng = np.random.default_rng(seed)
    popular = rng.dirichlet(np.full(experts, 0.5), size=layers)  # skewed routing, like real models
    return [
        (layer, sorted(rng.choice(experts, k, replace=False, p=popular[layer]).tolist()))
        for _ in range(steps)
        for layer in range(layers)
    ]


@pytest.mark.parametrize("slots", [2, 4, 8, 16])
def test_belady_is_an_upper_bound(slots):
    for seed in range(3):
        trace = random_trace(seed=seed)
        rates = {p: simulate(trace, slots, p, 4)["hit_rate"] for p in POLICIES}
        assert all(rates["belady"] >= r - 1e-12 for r in rates.values()), rates


def test_everything_fits_means_only_cold_misses():
    trace = random_trace()
    for p in POLICIES:
        r = simulate(trace, 32, p, 4)
        assert r["accesses"] - r["hits"] == len({(layer, e) for layer, es in trace for e in es})


def test_victims_follow_each_definition():
    lru, lfu, edge = LRU(4), LFU(4), EdgeMoE(4)
    for key in [(0, 1), (0, 1), (0, 1), (1, 2), (2, 3)]:
        for p in (lru, lfu, edge):
            p.touch(key, inserted=True)
    keys = [(0, 1), (1, 2), (2, 3)]
    assert lru.victim(keys, layer=3) == (0, 1)  # used longest ago
    assert lfu.victim(keys, layer=3) == (1, 2)  # used once, before (2, 3)
    # At layer 3: (0, 1) is 1 layer ahead (needed next), (1, 2) 2 ahead, (2, 3) 3 ahead; both of the
    # latter were used once, so the farthest one goes.
    assert edge.victim(keys, layer=3) == (2, 3)
    # While layer 2 is served, its other experts run again only on the next token, a whole cycle
    # (4 layers) away, farther than layer 1 (3 away).
    assert edge.victim([(1, 2), (2, 3)], layer=2) == (2, 3)


def test_slot_cache_never_evicts_what_the_step_needs():
    cache = ExpertCache(slots=3, expert_nbytes=8, n_layers=2, policy="lru")
    rng = np.random.default_rng(0)
    for _ in range(500):
        layer = int(rng.integers(2))
        wave = sorted(rng.choice(6, int(rng.integers(1, 4)), replace=False).tolist())
        todo = cache.place(layer, wave, pinned={(layer, e) for e in wave})
        assert all(cache.has(layer, e) for e in wave)
        slots = list(cache.slot_of.values())
        assert len(slots) == len(set(slots)) <= 3 and not set(slots) & set(cache.free)
        assert len(slots) + len(cache.free) == 3
        assert {e for e, _ in todo} <= set(wave)
