"""The file of a sequence's older KV (store/kv_tier_file.py): tokens written a step at a time read back
bit for bit in the read buffers' layout, nothing named on disk while it is held, its whole size
reserved at the start (a disk that cannot hold it is one line naming the bytes), writes outside it
refused."""

import numpy as np
import pytest

from mlx_flash.store.kv_tier_file import KVBlockFile, KVTierError, KVTierFile


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


def _page_aligned(shape, dtype) -> np.ndarray:
    """A writable array whose bytes start on a page, as the backends' host buffers do."""
    import mmap

    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, n), dtype).reshape(shape)


def test_aligned_reads_bypass_the_page_cache_and_read_what_was_written(tmp_path):
    """hd 128: a head's 64-token steps are 32 KiB, so reads into page-aligned buffers go through the
    O_DIRECT descriptor where the file system allows one, and read back the (buffered) writes."""
    rng = np.random.default_rng(1)
    f = KVTierFile(str(tmp_path), layers=2, kv_heads=2, head_dim=128, capacity=256)
    if f.direct_fd is None:
        pytest.skip("this file system refuses O_DIRECT")
    k, v = rng.standard_normal((2, 2, 2, 192, 128)).astype(np.float32)
    for layer in range(2):
        f.write(layer, 0, k[layer, :, :128], v[layer, :, :128])
        f.write(layer, 128, k[layer, :, 128:], v[layer, :, 128:])
    k_out, v_out = _page_aligned((2, 256, 128), np.float32), _page_aligned((2, 256, 128), np.float32)
    assert f.read_into(1, 0, 192, k_out, v_out) == 2 * 2 * 192 * 128 * 4
    assert np.array_equal(k_out[:, :192], k[1]) and np.array_equal(v_out[:, :192], v[1])
    f.close()


def test_blocks_written_read_back_in_parts_and_refused_off_a_block(tmp_path):
    rng = np.random.default_rng(2)
    f = KVBlockFile(str(tmp_path), layers=2, block_tokens=16, block_bytes=4096, capacity=100)
    assert f.blocks == 7 and f.nbytes == 2 * 7 * 4096
    data = rng.integers(0, 256, (2, 6, 4096), dtype=np.uint8)
    for layer in range(2):
        f.write_blocks(layer, 0, data[layer, :2])
        f.write_blocks(layer, 32, data[layer, 2:])
    out = _page_aligned((7, 4096), np.uint8)
    assert f.read_blocks(1, 0, 96, out) == 6 * 4096
    assert np.array_equal(out[:6], data[1])
    with pytest.raises(ValueError, match="token 40 does not start a block of 16"):
        f.read_blocks(0, 40, 96, out)
    with pytest.raises(ValueError, match="do not fit the file's 100 tokens"):
        f.write_blocks(0, 96, data[0, :2])
    f.close()
