"""The file of a sequence's older KV (store/kv_tier_file.py): tokens written a step at a time read back
bit for bit in the read buffers' layout, nothing named on disk while it is held, its whole size
reserved at the start (a disk that cannot hold it is one line naming the bytes), writes outside it
refused."""

import os
import shutil
import subprocess

import numpy as np
import pytest

from mlx_flash.store.kv_tier_file import KVBlockFile, KVTierError, KVTierFile, check_tier_folder


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


def test_a_file_no_disk_could_hold_is_said_at_the_start(tmp_path):
    with pytest.raises(KVTierError, match=r"^KV on flash for 1125899906842624 tokens \([0-9.]+ MB\): ") as e:
        KVTierFile(str(tmp_path), layers=1, kv_heads=1, head_dim=256, capacity=2**50)
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """Factory: a folder on a tmpfs of 1 MB (read-only with ro=True), unmounted after the test; skipped
    where this process may not mount one (not root, or no mount)."""
    mounted = []

    def make(ro: bool = False) -> str:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a small disk needs root and mount(8)")
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        opts = "size=1m" + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(str(where))
        return str(where)

    yield make
    for where in mounted:
        subprocess.run(["umount", where], check=True)


def test_a_full_disk_is_named_with_the_bytes_needed_and_free(small_disk):
    """2 MB of KV on a 1 MB disk: one line naming the tokens, the bytes, the folder, that the disk is
    full and what is free; nothing left behind."""
    folder = os.path.join(small_disk(), "kv")
    with pytest.raises(KVTierError) as e:
        KVTierFile(folder, layers=2, kv_heads=2, head_dim=64, capacity=1024)
    assert str(e.value) == f"KV on flash for 1024 tokens (2.1 MB): {folder}: the disk is full (1.0 MB free)"
    assert os.listdir(folder) == []


def test_a_read_only_disk_is_named_at_load_and_when_the_file_is_made(small_disk):
    folder = os.path.join(small_disk(ro=True), "kv")
    with pytest.raises(KVTierError) as e:
        check_tier_folder(folder)
    assert str(e.value) == f"KV on flash: {folder}: the disk is read-only"
    with pytest.raises(KVTierError) as e:
        KVTierFile(folder, layers=1, kv_heads=1, head_dim=64, capacity=1000)
    assert str(e.value) == f"KV on flash for 1000 tokens (0.5 MB): {folder}: the disk is read-only"


@pytest.mark.parametrize("blocked", ["kv", "cache"])
def test_a_file_where_the_folder_should_be_is_named_at_load_and_when_the_file_is_made(tmp_path, blocked):
    """The folder itself a plain file, or a folder above it: each names the file in the way."""
    folder = str(tmp_path / "cache" / "kv")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kv").write_text("not a folder")
    if blocked == "cache":
        os.remove(folder)
        os.rmdir(tmp_path / "cache")
        (tmp_path / "cache").write_text("not a folder")
    blocker = str(tmp_path / blocked) if blocked == "cache" else folder
    with pytest.raises(KVTierError) as e:
        check_tier_folder(folder)
    assert str(e.value) == f"KV on flash: {folder}: {blocker} is a file, not a folder"
    with pytest.raises(KVTierError) as e:
        KVTierFile(folder, layers=1, kv_heads=1, head_dim=64, capacity=1000)
    assert str(e.value) == f"KV on flash for 1000 tokens (0.5 MB): {folder}: {blocker} is a file, not a folder"
    check_tier_folder(str(tmp_path / "elsewhere" / "kv"))  # a folder still to be made is fine


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
