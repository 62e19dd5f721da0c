"""Perplexity: both backends agree, and the number matches one computed from transformers' logits."""

import numpy as np
import pytest

from mlx_flash.calibrate.perplexity_eval import perplexity, token_nlls

torch = pytest.importorskip("torch")


def test_token_nlls_matches_definition():
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    expect = [-np.log(np.exp(1.0) / np.exp([1.0, 2.0, 3.0]).sum()), np.log(3.0)]
    np.testing.assert_allclose(token_nlls(logits, np.array([0, 2])), expect)


@pytest.mark.slow
@pytest.mark.full  # ~40 s; both backends' logits against transformers: tests/models/test_smollm2_vs_transformers.py
def test_backends_agree_and_match_transformers(engines, store_dir, f16_store_dir, wiki_text, hf_reference):
    # MLX on a Linux CPU is slow, so the suite scores 512 tokens; python -m mlx_flash.bench perplexity does 4096.
    n, ctx = 512, 256
    r_mlx = perplexity(engines(store_dir, "mlx"), wiki_text, ctx, n)
    r_torch = perplexity(engines(store_dir, "torch"), wiki_text, ctx, n)
    assert abs(r_mlx["perplexity"] / r_torch["perplexity"] - 1) < 1e-3
    # Independent reference on the lossless (f16) store: transformers' NLL over the same windows.
    ids = engines(f16_store_dir, "torch").tokenizer.encode(wiki_text)[:n]
    nll = 0.0
    for s in range(0, n - 1, ctx):
        w = ids[s : s + ctx]
        with torch.no_grad():
            lg = hf_reference(torch.tensor([w])).logits[0].numpy()
        nll += token_nlls(lg[:-1], np.asarray(w[1:])).sum()
    ref = float(np.exp(nll / (n - n // ctx)))
    ours = perplexity(engines(f16_store_dir, "torch"), wiki_text, ctx, n)["perplexity"]
    assert abs(ours / ref - 1) < 2e-3, (ours, ref)
