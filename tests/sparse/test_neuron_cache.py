"""Neuron cache and window invariants under thousands of random insert/delete steps: pointers unique
and consistent with the inverse map, live rows equal the bundle rows of the neurons they name, the
slab never exceeds capacity, and the window union equals a brute-force union."""

import numpy as np
import pytest

from mlx_flash.sparse.neuron_cache import NeuronCache
from mlx_flash.sparse.window import ActiveWindow

F, ROW = 300, 24


def bundle(ids):
    """Stand-in bundle file: row i's bytes are a function of i."""
    ids = np.asarray(ids)
    return ((ids[:, None] * 7 + np.arange(ROW)[None, :] * 13) % 251).astype(np.uint8)


def check(cache: NeuronCache):
    live = cache.live_ids()
    assert live.size == cache.num_used <= cache.capacity
    assert np.unique(live).size == live.size and (live >= 0).all()
    assert (cache.ids[cache.num_used :] == -1).all()
    assert (cache.slot[live] == np.arange(live.size)).all()
    assert (cache.slot >= 0).sum() == live.size
    np.testing.assert_array_equal(cache.live_rows(), bundle(live))


def test_random_insert_delete_keeps_invariants():
    rng = np.random.default_rng(0)
    cache = NeuronCache(capacity=120, row_bytes=ROW, n_neurons=F)
    for step in range(3000):
        live = cache.live_ids()
        if live.size and rng.random() < 0.5:
            cache.delete(rng.choice(live, rng.integers(1, live.size + 1), replace=False))
        else:
            absent = np.setdiff1d(np.arange(F), live)
            k = int(rng.integers(0, cache.capacity - cache.num_used + 1))
            new = rng.choice(absent, k, replace=False)
            rows = cache.append(new)
            cache.rows[rows] = bundle(new)  # what the reader does
        check(cache)
    assert cache.moved_rows > 0


def test_misuse_is_refused():
    cache = NeuronCache(capacity=4, row_bytes=ROW, n_neurons=F)
    cache.append(np.array([1, 2]))
    with pytest.raises(KeyError):
        cache.append(np.array([2]))
    with pytest.raises(KeyError):
        cache.delete(np.array([3]))
    with pytest.raises(ValueError, match="full"):
        cache.append(np.array([5, 6, 7]))


def test_window_union_matches_brute_force_and_respects_capacity():
    rng = np.random.default_rng(1)
    for k, capacity in [(1, F), (4, F), (5, 60)]:
        win = ActiveWindow(k, F)
        history = []
        for _ in range(500):
            active = np.unique(rng.choice(F, int(rng.integers(1, 40)), replace=False))
            win.push(active, capacity)
            history.append(active)
            kept = history[-win.tokens :]
            expect = np.unique(np.concatenate(kept))
            np.testing.assert_array_equal(win.members(), expect)
            assert win.union_size == expect.size
            assert win.tokens <= k and (win.tokens == 1 or expect.size <= capacity)
            # the window only shrinks when it must
            if win.tokens < min(k, len(history)):
                wider = np.unique(np.concatenate(history[-win.tokens - 1 :]))
                assert wider.size > capacity
