"""mlx_flash/bench/throughput.py:against_single, what `python -m mlx_flash.bench throughput` prints
under its table: the cap one at a time's prefill puts on a batched mode's ratio, the share of it measured, and
whether the batched sequences generated the tokens they did one at a time."""

import pytest

from mlx_flash.bench.throughput import against_single


def rows(batched_tokens):
    single = {"mode": "single", "label": "single", "sequences": 2, "prefill_s": 1.0, "decode_s": 4.0}
    single.update(tokens_per_s=4.0, tokens=[[5, 6, 7], [8, 9]])  # the second ended on EOS after 2
    batched = {"mode": "flexgen", "label": "flexgen", "tokens_per_s": 18.0, "tokens": batched_tokens}
    return [single, batched]


def test_the_cap_and_its_share():
    r = rows([[5, 6, 7], [8, 9], [1, 2, 3]])
    lines = against_single(r)
    assert r[1]["cap"] == pytest.approx(5.0)  # (0.5 + 2.0) / 0.5 a sequence
    assert r[1]["of_cap"] == pytest.approx(18.0 / 4.0 / 5.0)
    assert r[1]["same_as_single"] is True
    assert "5.00x" in lines[0] and "0.90 of the cap" in lines[1] and "same tokens" in lines[1]


def test_a_sequence_that_differs_is_named():
    r = rows([[5, 6, 7], [8, 4, 0], [1, 2, 3]])
    lines = against_single(r)
    assert r[1]["same_as_single"] is False and "DIFFER" in lines[1]


def test_no_single_row_no_lines():
    assert against_single(rows([[5]])[1:]) == []
