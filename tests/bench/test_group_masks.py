"""Inputs zeroed by whole groups (mlx_flash/bench/group_masks.py): thresholds from text, masks constant
within a group, and a threshold nothing falls below leaving the model as it was."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.bench import group_masks as gm
from mlx_flash.calibrate.perplexity_eval import perplexity

TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 30


@pytest.mark.parametrize("group", [1, 32])
def test_a_group_at_or_below_its_threshold_is_zeroed_whole(calibrated_q4, group):
    with mlx_flash.load(calibrated_q4, backend="torch", ffn="resident", progress=False) as e:
        x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
        x[0, :32] *= 0.01  # row 0's first group is quiet
        t = float(np.sqrt(np.mean(x[0, :32] ** 2))) * 1.5 if group == 32 else 0.5
        ops = gm.GroupOps(e.ops, {}, group, {(0, "o"): t})
        got = e.ops.to_numpy(ops.seen(e.ops.array(x), None, (0, "o")))
    rms = np.sqrt(np.mean(x.reshape(3, -1, group) ** 2, axis=2))
    want = x * np.repeat(rms > t, group, axis=1)
    np.testing.assert_array_equal(got, want)
    if group == 32:
        assert (got[0, :32] == 0).all() and (got[0, 32:] == x[0, 32:]).all()


def test_thresholds_nothing_falls_below_leave_the_perplexity_as_it_was(calibrated_q4):
    with mlx_flash.load(calibrated_q4, backend="torch", ffn="resident", progress=False) as e:
        dense = perplexity(e, TEXT, context=64, max_tokens=128)["perplexity"]
        keys = gm.group_thresholds(e, e.tokenizer.encode(TEXT)[:64], 32, 0.5, context=64)
        none = gm.group_perplexity(e, TEXT, 32, {k: -1.0 for k in keys}, tokens=128, context=64)
        half = gm.group_perplexity(e, TEXT, 32, keys, tokens=128, context=64)
    assert none == pytest.approx(dense, rel=1e-6)
    assert half != pytest.approx(dense, rel=1e-3)


def test_open_loop_masks_zero_the_level_of_each_inputs_groups(calibrated_q4):
    with mlx_flash.load(calibrated_q4, backend="torch", ffn="resident", progress=False) as e:
        rms = gm.group_rms(e, e.tokenizer.encode(TEXT)[:48], 32, context=48)
    masks = gm.open_loop_masks(rms, 32, 0.5)
    for key, m in masks.items():
        assert m.shape == (48, rms[key].shape[1] * 32)
        assert 1 - m.mean() == pytest.approx(0.5, abs=0.03)
        kept = m[:, ::32]  # one channel per group stands for it
        assert rms[key][~kept].max() <= rms[key][kept].min()  # the quietest groups are the ones zeroed
