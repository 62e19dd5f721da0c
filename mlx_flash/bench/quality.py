"""What a numeric choice costs on held-out text, against the exact arithmetic and the peers: perplexity
over the first tokens of the Wikipedia set in windows scored from an empty cache (llama.cpp fed the
same token ids and windows), and greedy continuations of prompts taken far from those tokens, compared
token for token with exact's, transformers' (the checkpoint dequantized to float32) and llama.cpp's."""

from __future__ import annotations

import math
import os

import numpy as np

from ..calibrate import corpus_path, perplexity
from ..calibrate.perplexity_eval import token_nlls

PROMPT_AT = (1000, 20000, 40000, 60000, 80000)  # token offsets of the held-out prompts (past 4,096)


def wikipedia(chars: int) -> str:
    with open(corpus_path("wikipedia"), encoding="utf-8") as fh:
        return fh.read()[:chars]


def engine_perplexity(engine, tokens: int = 4096, context: int = 512) -> dict:
    return perplexity(engine, wikipedia(tokens * 12), context=context, max_tokens=tokens)


def llama_perplexity(gguf: str, ids: list[int], threads: int, context: int = 512) -> float | None:
    """llama.cpp's perplexity over the same windows of the same token ids (None when llama-cpp-python
    is not installed)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(gguf, n_ctx=context, n_threads=threads, n_batch=context, logits_all=True, verbose=False)
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, context):
        window = ids[s : s + context]
        if len(window) < 2:
            break
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window)], dtype=np.float64)
        nll += float(token_nlls(logits[:-1], np.asarray(window[1:])).sum())
        count += len(window) - 1
    return math.exp(nll / count)


def held_out_prompts(tokenizer, length: int = 48) -> list[list[int]]:
    ids = tokenizer.encode(wikipedia(400_000))
    return [ids[i : i + length] for i in PROMPT_AT]


def greedy_tokens(engine, ids, steps: int) -> list[int]:
    """`steps` greedy tokens after a prefill of token ids `ids` (EOS ignored)."""
    caches = engine.new_caches()
    logits = engine.prefill(ids, caches)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(logits)))
        logits = engine.forward([out[-1]], caches)[-1]
    return out


def llama_greedy(llm, ids, steps: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)))))
        llm.eval([out[-1]])
    return out


def hf_references(model, prompts, steps: int) -> list[tuple]:
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


def transformers_greedy(gguf: str, prompts, steps: int) -> list[list[int]]:
    """transformers' greedy continuations of the GGUF (its own loader, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    )
    return [r[2] for r in hf_references(model, prompts, steps)]


def agreement(runs: dict[str, list[list[int]]], against: list[str]) -> dict:
    """For each run, how many of its continuations equal each reference's, token for token."""
    return {
        name: {ref: sum(a == b for a, b in zip(seq, runs[ref])) for ref in against if ref != name}
        for name, seq in runs.items()
    }
