"""The two files of a store's sparsity predictors (sparse/predictor.py) are saved one after the
other: a pair from two trainings (a save cut short between them) is refused in one line, never
loaded as one."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from mlx_flash.errors import StoreError
from mlx_flash.sparse.predictor import META_NAME, WEIGHTS_NAME, LayerPredictor, Predictors

LAYERS, D, F = 2, 8, 16


def predictors(seed: int) -> Predictors:
    rng = np.random.default_rng(seed)
    per = [
        LayerPredictor(rng.random((D, 4), np.float32), rng.random((4, F), np.float32), rng.random(F, np.float32), 0.1)
        for _ in range(LAYERS)
    ]
    return Predictors(per, 0.5, [0.01 * (seed + 1)] * LAYERS)


def test_saved_predictors_load_back(tmp_path):
    predictors(0).save(str(tmp_path))
    got = Predictors.load(str(tmp_path), LAYERS, D, F)
    np.testing.assert_array_equal(got.layers[1].V, predictors(0).layers[1].V)
    assert sorted(os.listdir(tmp_path)) == sorted([META_NAME, WEIGHTS_NAME])  # no temporaries left


@pytest.mark.parametrize("kept", [META_NAME, WEIGHTS_NAME])
def test_files_of_two_trainings_are_refused_in_one_line(tmp_path, kept):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    predictors(0).save(str(old))
    predictors(1).save(str(new))
    shutil.copy(old / kept, new / kept)  # one file of each training: a save cut short between the two
    with pytest.raises(StoreError, match="are of different trainings") as e:
        Predictors.load(str(new), LAYERS, D, F)
    assert "\n" not in str(e.value)
