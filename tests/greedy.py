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


def greedy_tokens(engine, ids, steps):
    """`steps` greedy tokens after a prefill of token ids `ids` (EOS ignored)."""
    caches = engine.new_caches()
    logits = engine.prefill(ids, caches)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(logits)))
        logits = engine.forward([out[-1]], caches)[-1]
    return out


def hf_references(model, prompts, steps):
    """[(ids, logits [T, vocab], `steps` greedy tokens)] of a transformers model on each prompt."""
    import torch

    out = []
    for ids in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy()
            tokens = model.generate(
                torch.tensor([ids]),
                max_new_tokens=steps,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        out.append((ids, logits, tokens[0, len(ids) :].tolist()))
    return out


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
