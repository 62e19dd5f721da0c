"""Greedy decoding for exactness tests: every step's logits, EOS ignored (a test wants n steps)."""

import numpy as np

from mlx_flash.bench.quality import greedy_tokens, hf_references  # noqa: F401 (the tests take them from here)


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


def kernel_and_reference_runs(open_engine, prompt, n):
    """{"auto": ..., "reference": ...}: greedy runs (greedy()) of a sparse engine opened by
    `open_engine(kernel)` through the backend's sparse kernel and through the reference path, each
    checked to have used that path on a partial selection."""
    runs = {}
    for kernel in ("auto", "reference"):
        with open_engine(kernel) as e:
            runs[kernel] = greedy(e, prompt, n)
            st = e.ffn.stats()
            assert st.sparse_kernel == ("cpu" if kernel == "auto" else "reference")
            assert 0 < st.rows_active < st.decode_layer_steps * st.neurons
    return runs
