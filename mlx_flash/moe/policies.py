"""Expert-cache eviction policies (EdgeMoE §6 and the baselines it is compared with).

A cache holds (layer, expert) keys in a fixed number of slots shared by all MoE layers. When a
routed expert misses and no slot is free, the policy names the victim among the keys the current
step does not need. Policies see every access through `touch` and keep their own statistics; they
never read or write expert bytes.

  lru      least recently used
  lfu      least frequently used (ties: least recently used)
  fifo     first in, first out
  edgemoe  EdgeMoE's score: evict the expert that is rarely routed (frequency f_ij of expert j at
           layer i, counted over everything seen) and far from being needed, the distance being how
           many layers from now layer i runs again in cyclic order over S MoE layers:
           (i - I - 1) mod S + 1 while layer I is being served, so the next layer is 1 away and the
           current layer's other experts, needed only on the next token, a whole cycle (S) away;
           the lowest f_ij / distance goes first
  belady   the offline optimum: evict the key whose next use lies farthest in the future (needs the
           whole access trace, so it exists only in `simulate`)
"""

from __future__ import annotations

from collections import defaultdict

from ..choices import ExpertPolicy
from ..errors import ConfigError


ONLINE_POLICIES = tuple(p.value for p in ExpertPolicy)
POLICIES = ONLINE_POLICIES + ("belady",)


class Policy:
    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.clock = 0  # one tick per access
        self.last_use: dict = {}
        self.inserted: dict = {}
        self.freq: dict = defaultdict(int)

    def touch(self, key, inserted: bool) -> None:
        self.clock += 1
        self.last_use[key] = self.clock
        self.freq[key] += 1
        if inserted:
            self.inserted[key] = self.clock

    def admit(self, key) -> None:
        """A key cached before anyone asked for it (a preload): it arrives now but is not yet used."""
        self.last_use[key] = self.clock
        self.inserted[key] = self.clock

    def forget(self, key) -> None:
        self.inserted.pop(key, None)

    def victim(self, candidates: list, layer: int):
        raise NotImplementedError


class LRU(Policy):
    def victim(self, candidates, layer):
        return min(candidates, key=lambda k: self.last_use[k])


class LFU(Policy):
    def victim(self, candidates, layer):
        return min(candidates, key=lambda k: (self.freq[k], self.last_use[k]))


class FIFO(Policy):
    def victim(self, candidates, layer):
        return min(candidates, key=lambda k: self.inserted[k])


class EdgeMoE(Policy):
    def victim(self, candidates, layer):
        S = self.n_layers

        def score(k):
            distance = (k[0] - layer - 1) % S + 1  # layers until this expert's layer runs again
            return (self.freq[k] / distance, self.last_use[k])

        return min(candidates, key=score)


def make_policy(name: "ExpertPolicy | str", n_layers: int) -> Policy:
    name = name.value if isinstance(name, ExpertPolicy) else name
    classes = {"edgemoe": EdgeMoE, "lru": LRU, "lfu": LFU, "fifo": FIFO}  # ONLINE_POLICIES
    if name not in classes:
        extra = " (belady needs the future: it exists only in moe.policies.simulate)" if name == "belady" else ""
        raise ConfigError(
            f"expert cache policy {name!r} is unknown{extra} (choose one of: {', '.join(ONLINE_POLICIES)})"
        )
    return classes[name](n_layers)


def simulate(trace: list[tuple[int, list[int]]], slots: int, policy: str, n_layers: int) -> dict:
    """Hit statistics of a cache of `slots` experts over an access trace [(layer, experts routed
    there by one step), ...] in execution order, with no prefetch. Returns {"hits", "accesses",
    "hit_rate", "per_layer": [[hits, accesses], ...]}."""
    if slots < 1:
        raise ValueError("a cache needs at least one slot")
    flat = [((layer, e), step) for step, (layer, experts) in enumerate(trace) for e in experts]
    next_use = [0] * len(flat)
    if policy == "belady":
        seen: dict = {}
        for n in range(len(flat) - 1, -1, -1):
            next_use[n] = seen.get(flat[n][0], float("inf"))
            seen[flat[n][0]] = n
        upcoming: dict = {}
    else:
        pol = make_policy(policy, n_layers)
    cached: set = set()
    per_layer = [[0, 0] for _ in range(n_layers)]
    for n, (key, step) in enumerate(flat):
        layer = key[0]
        needed_now = {(layer, e) for e in trace[step][1]}
        hit = key in cached
        per_layer[layer][0] += hit
        per_layer[layer][1] += 1
        if not hit:
            if len(cached) >= slots:
                candidates = [k for k in cached if k not in needed_now] or list(cached)
                if policy == "belady":
                    v = max(candidates, key=lambda k: upcoming[k])
                else:
                    v = pol.victim(candidates, layer)
                    pol.forget(v)
                cached.discard(v)
            cached.add(key)
        if policy == "belady":
            upcoming[key] = next_use[n]
        else:
            pol.touch(key, inserted=not hit)
    hits, accesses = sum(h for h, _ in per_layer), sum(a for _, a in per_layer)
    return {"hits": hits, "accesses": accesses, "hit_rate": hits / max(1, accesses), "per_layer": per_layer}
