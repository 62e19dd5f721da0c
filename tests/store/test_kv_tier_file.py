"""The file of a sequence's older KV (store/kv_tier_file.py): tokens written a step at a time read back
bit for bit in the read buffers' layout, nothing named on disk while it is held, its whole size
reserved at the start (a disk that cannot hold it is one line naming the bytes), writes outside it
refused."""

import numpy as np
import pytest

from mlx_flash.store.kv_tier_file import KVTierError, KVTierFile


def test_steps_written_read_back_in_the_read_buffers_layout(tmp_path):
    rng = np.random.default_rng(0)
    f = KVTierFile(str(tmp_path), layers=3, kv_heads=2, head_dim=8, capacity=100)
    k, v = rng.standard_normal((2, 3, 2, 90, 8)).astype(np.float32)  # [layer, head, token, dim] each
    for start in range(0, 90, 30):  # three moves out of a window, each layer's
        for layer in range(3):
            f.write(layer, start, k[layer, :, start : start + 30], v[layer, :, start : start + 30])
    for layer in range(3):
        k_out, v_out = np.full((2, 2, 100, 8), np.nan, np.float32)  # a read buffer of the whole context
        f.read_into(layer, 0, 40, k_out, v_out)
        f.read_into(layer, 40, 75, k_out, v_out)  # the rest of a read ahead: from where it stopped
        assert np.array_equal(k_out[:, :75], k[layer, :, :75]) and np.array_equal(v_out[:, :75], v[layer, :, :75])
        assert np.isnan(k_out[:, 75:]).all()  # nothing past the tokens asked for
    assert f.bytes_written == 2 * 3 * 2 * 90 * 8 * 4 and list(tmp_path.iterdir()) == []
    f.close()


def test_a_disk_that_cannot_hold_it_is_said_at_the_start(tmp_path):
    with pytest.raises(KVTierError, match=r"cannot reserve [0-9.]+ [A-Z]B for 1125899906842624 tokens") as e:
        KVTierFile(str(tmp_path), layers=1, kv_heads=1, head_dim=256, capacity=2**50)
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def test_writes_outside_the_file_are_refused(tmp_path):
    f = KVTierFile(str(tmp_path), layers=1, kv_heads=1, head_dim=4, capacity=10)
    with pytest.raises(ValueError, match=r"tokens \[8, 12\) are outside the file's 10"):
        f.write(0, 8, np.zeros((1, 4, 4), np.float32), np.zeros((1, 4, 4), np.float32))
