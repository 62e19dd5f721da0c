"""Speculative decoding with prompt-lookup drafts: the drafting rule, and greedy output identical to
plain greedy decoding (dense and sparse FFN), with drafts actually accepted."""

import pytest

import mlx_flash
from mlx_flash.errors import ConfigError
from mlx_flash.speculative import accepted_prefix, ngram_draft

PROMPT = (
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the log. The cat sat on the"
)


def test_ngram_draft_takes_the_latest_longest_match():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_draft(ctx, 2) == [7, 8]  # latest earlier "1 2 3" is followed by 7 8
    assert ngram_draft([5, 6, 7], 3) == []
    assert ngram_draft([4, 4], 3) == [4]
    assert accepted_prefix([7, 8, 9], [7, 8, 1, 2]) == 2
    assert accepted_prefix([], [3]) == 0


# both in the full tier (~8 s, ~25 s): the default tier decodes speculatively across ranks (test_pipeline.py)
@pytest.mark.parametrize("ffn", [pytest.param(f, marks=pytest.mark.full) for f in ("resident", "sparse")])
def test_speculative_greedy_equals_plain_greedy(f16_store_dir, ffn):
    kw = (
        dict(ffn="sparse", weights_budget="60%", flash=mlx_flash.FlashOptions(mode="all", predictor="dense"))
        if ffn == "sparse"
        else {}
    )
    with mlx_flash.load(
        f16_store_dir, backend="torch", progress=False, io=mlx_flash.IOOptions(mode="buffered"), **kw
    ) as e:
        plain = [s.token for s in e.stream_generate(PROMPT, max_tokens=48)]
        spec = [s.token for s in e.stream_generate(PROMPT, max_tokens=48, speculative=4)]
        summary = e.last
    assert spec == plain
    assert summary.draft_accepted > 10 and summary.draft_proposed >= summary.draft_accepted


def test_speculative_needs_greedy(engines, store_dir):
    e = engines(store_dir, "torch")
    with pytest.raises(ConfigError, match="temperature 0"):
        e.generate("Hi", max_tokens=2, temperature=0.7, speculative=3)
