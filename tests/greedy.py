"""Greedy decoding for exactness tests: every step's logits, EOS ignored (a test wants n steps)."""

import numpy as np


def greedy(e, prompt, n):
    """(n greedy tokens, logits of every step [n + 1, vocab]) from token ids `prompt`."""
    caches, toks = e.new_caches(), []
    logits = np.asarray(e.forward(prompt, caches)).reshape(-1)
    seen = [logits]
    for _ in range(n):
        toks.append(int(np.argmax(logits)))
        logits = np.asarray(e.forward([toks[-1]], caches)).reshape(-1)
        seen.append(logits)
    return toks, np.stack(seen)
