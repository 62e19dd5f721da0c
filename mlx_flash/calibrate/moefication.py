"""MoEfication: turn a dense SwiGLU model into a mixture of experts with real routing statistics.

No MoE checkpoint is reachable offline, so the EdgeMoE measurements run on a model derived from the
default dense one: each layer's F FFN neurons are split into E equal experts of neurons that fire
together on calibration text (balanced k-means over the neurons' activation patterns), and a linear
router per layer is trained to score the experts by how much each adds to that token's FFN output.
A token then runs its top-K experts unweighted: the experts are pieces of one dense FFN, so the
chosen pieces add up as they did in the dense sum, and with K = E the derived model is the dense one
(up to summation order). Results from it are labelled derived wherever they are reported.

Numpy in, numpy out; training uses torch on the CPU.
Shapes: N tokens, D d_model, F d_ff, E experts, Fe = F / E neurons per expert.
"""

from __future__ import annotations

import numpy as np


def balanced_clusters(patterns: np.ndarray, n_experts: int, iters: int = 20, seed: int = 0) -> np.ndarray:
    """patterns [F, N] (each neuron's activation magnitude over N tokens) -> expert id per neuron
    [F], every expert getting exactly F / E neurons. Cosine k-means; the assignment step fills the
    experts greedily from the most similar (neuron, centroid) pair down, so sizes stay equal."""
    F = patterns.shape[0]
    if F % n_experts:
        raise ValueError(f"{F} neurons do not split evenly into {n_experts} experts")
    size = F // n_experts
    V = patterns.astype(np.float32)
    V = V - V.mean(1, keepdims=True)
    V /= np.linalg.norm(V, axis=1, keepdims=True) + 1e-8
    rng = np.random.default_rng(seed)
    C = V[rng.choice(F, n_experts, replace=False)]
    assign = np.full(F, -1)
    for _ in range(iters):
        S = V @ C.T  # [F, E]
        new = np.full(F, -1)
        room = np.full(n_experts, size)
        for flat in np.argsort(-S, axis=None, kind="stable"):
            j, e = divmod(int(flat), n_experts)
            if new[j] < 0 and room[e]:
                new[j] = e
                room[e] -= 1
        if np.array_equal(new, assign):
            break
        assign = new
        C = np.stack([V[assign == e].mean(0) for e in range(n_experts)])
        C /= np.linalg.norm(C, axis=1, keepdims=True) + 1e-8
    return assign


def expert_order(assign: np.ndarray, n_experts: int) -> np.ndarray:
    """Neuron ids grouped by expert [F]: expert e's neurons are entries [e*Fe, (e+1)*Fe), ascending."""
    return np.concatenate([np.nonzero(assign == e)[0] for e in range(n_experts)])


def expert_contributions(
    x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, order: np.ndarray, n_experts: int
) -> np.ndarray:
    """||expert e's share of the FFN output|| per token [N, E]: x [N, D], gate/up [F, D], down [D, F]
    of the dense layer, neurons grouped by `order`. The router learns to rank experts by this."""
    import torch

    with torch.no_grad():
        X = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        g, u = (torch.from_numpy(np.ascontiguousarray(w[order], dtype=np.float32)) for w in (gate, up))
        d = torch.from_numpy(np.ascontiguousarray(down[:, order], dtype=np.float32))
        h = torch.nn.functional.silu(X @ g.T) * (X @ u.T)  # [N, F], grouped
        Fe = len(order) // n_experts
        return np.stack(
            [
                torch.linalg.vector_norm(h[:, e * Fe : (e + 1) * Fe] @ d[:, e * Fe : (e + 1) * Fe].T, dim=1).numpy()
                for e in range(n_experts)
            ],
            axis=1,
        )


def train_router(
    x: np.ndarray, scores: np.ndarray, epochs: int = 30, lr: float = 3e-2, batch: int = 512, seed: int = 0
) -> np.ndarray:
    """A linear router [E, D] whose softmax over experts matches each token's share of the output
    norm (scores [N, E] normalized per token; cross-entropy). Top-K of its logits picks the experts."""
    import torch

    g = torch.Generator().manual_seed(seed)
    X = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    P = torch.from_numpy((scores / scores.sum(1, keepdims=True)).astype(np.float32))
    W = torch.nn.Parameter(torch.zeros(scores.shape[1], x.shape[1]))
    opt = torch.optim.Adam([W], lr=lr)
    steps = epochs * ((len(X) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(epochs):
        perm = torch.randperm(len(X), generator=g)
        for s in range(0, len(X), batch):
            idx = perm[s : s + batch]
            loss = -(P[idx] * torch.log_softmax(X[idx] @ W.T, dim=1)).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return W.detach().numpy()


def router_quality(router: np.ndarray, x: np.ndarray, scores: np.ndarray, k: int) -> dict:
    """How well the router's top-k matches the oracle top-k by contribution, on held-out tokens:
    recall of the oracle experts, and the share of the summed contribution norms its picks cover."""
    picked = np.argsort(-(x @ router.T), axis=1, kind="stable")[:, :k]
    oracle = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    hit = np.mean([len(set(a) & set(b)) / k for a, b in zip(picked, oracle)])
    covered = np.take_along_axis(scores, picked, 1).sum(1) / scores.sum(1)
    best = np.take_along_axis(scores, oracle, 1).sum(1) / scores.sum(1)
    return {"oracle_recall": float(hit), "covered": float(covered.mean()), "oracle_covered": float(best.mean())}
