"""Inputs zeroed by whole groups (mlx_flash/bench/group_masks.py): thresholds from text, masks constant
within a group, and a threshold nothing falls below leaving the model as it was."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.bench import group_masks as gm
from mlx_flash.calibrate.perplexity_eval import perplexity

TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 30


@pytest.mark.parametrize("group", [1, 32])
def test_groups_are_zeroed_whole_at_about_their_level(calibrated_q4, group):
    with mlx_flash.load(calibrated_q4, backend="torch", ffn="resident", progress=False) as e:
        ids = e.tokenizer.encode(TEXT)
        thresholds = gm.group_thresholds(e, ids[:128], group, 0.5, context=64)
        masks = gm.group_masks(e, ids[:40], group, thresholds)
    assert {role for _, role in masks} == {"qkv", "o", "gate_up", "down"}
    zeroed = [1 - m.mean() for m in masks.values()]
    assert 0.2 < float(np.mean(zeroed)) < 0.8
    for m in masks.values():
        assert m.shape[0] == 40
        by_group = m.reshape(40, -1, group)
        assert (by_group.all(axis=2) | ~by_group.any(axis=2)).all()  # each group all on or all off


def test_thresholds_nothing_falls_below_leave_the_perplexity_as_it_was(calibrated_q4):
    with mlx_flash.load(calibrated_q4, backend="torch", ffn="resident", progress=False) as e:
        dense = perplexity(e, TEXT, context=64, max_tokens=128)["perplexity"]
        keys = gm.group_thresholds(e, e.tokenizer.encode(TEXT)[:64], 32, 0.5, context=64)
        none = gm.group_perplexity(e, TEXT, 32, {k: -1.0 for k in keys}, tokens=128, context=64)
        half = gm.group_perplexity(e, TEXT, 32, keys, tokens=128, context=64)
    assert none == pytest.approx(dense, rel=1e-6)
    assert half != pytest.approx(dense, rel=1e-3)
