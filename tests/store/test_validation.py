"""Opening a store validates the manifest completely; each defect is one named StoreError."""

import os
import shutil

import pytest

from mlx_flash.errors import ModelNotFoundError, StoreError
from mlx_flash.store import open_store


@pytest.fixture
def tiny(tiny_store, tmp_path):
    store_dir, _ = tiny_store("llama")
    return store_dir


from tiny_models import edit_manifest  # noqa: E402  (re-seals: these tests reach the checks behind the seal)


def test_valid_store_opens_with_checksums(tiny):
    s = open_store(tiny, verify_checksums=True)
    assert s.config["model_type"] == "llama"


def test_truncated_bundle_file(tiny):
    path = os.path.join(tiny, "ffn_bundles.bin")
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 4096)
    with pytest.raises(StoreError, match=r"ffn_bundles\.bin: size is .*truncated"):
        open_store(tiny)


def test_offset_past_end_of_file(tiny):
    def push(m):
        t = m["tensors"]["model.norm.weight"]
        t["offset"] = m["files"][t["file"]]["size"] - 8

    edit_manifest(tiny, push)
    with pytest.raises(StoreError, match=r"resident\.safetensors: tensor model\.norm\.weight spans .* past the end"):
        open_store(tiny)


def test_ffn_layer_past_end(tiny):
    edit_manifest(tiny, lambda m: m["ffn"]["layer_offsets"].__setitem__(1, 4096 * 1000))
    with pytest.raises(StoreError, match="FFN layer 1 bundles spans"):
        open_store(tiny)


def test_overlapping_tensors(tiny):
    def overlap(m):
        names = sorted(m["tensors"])
        a, b = m["tensors"][names[0]], m["tensors"][names[1]]
        b["offset"] = a["offset"]

    edit_manifest(tiny, overlap)
    with pytest.raises(StoreError, match="overlap"):
        open_store(tiny)


def test_shape_disagrees_with_size(tiny):
    edit_manifest(tiny, lambda m: m["tensors"]["model.norm.weight"].__setitem__("shape", [3]))
    with pytest.raises(StoreError, match="model.norm.weight shape"):
        open_store(tiny)


def test_checksum_mismatch(tiny):
    """Sizes and offsets still fine, the modification time put back: the file changed since its
    stamp (its ctime moved), so it is hashed again and refused."""
    open_store(tiny)  # hashed and stamped
    path = os.path.join(tiny, "ffn_bundles.bin")
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(StoreError, match="ffn_bundles.bin: sha256 mismatch"):
        open_store(tiny)
    with pytest.raises(StoreError, match="sha256 mismatch"):
        open_store(tiny, verify_checksums=True)


def test_missing_file_and_bad_json(tiny, tmp_path):
    broken = str(tmp_path / "copy")
    shutil.copytree(tiny, broken)
    os.remove(os.path.join(broken, "resident.safetensors"))
    with pytest.raises(StoreError, match="resident.safetensors: file listed in the manifest is missing"):
        open_store(broken)
    with open(os.path.join(tiny, "manifest.json"), "w") as fh:
        fh.write("{not json")
    with pytest.raises(StoreError, match="manifest is not valid JSON"):
        open_store(tiny)


def test_not_a_store(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such store"):
        open_store(str(tmp_path / "nope"))
    with pytest.raises(StoreError, match="not a store"):
        open_store(str(tmp_path))


def test_future_format_version(tiny):
    edit_manifest(tiny, lambda m: m.__setitem__("format_version", 99))
    with pytest.raises(StoreError, match="format version 99 is not supported"):
        open_store(tiny)


@pytest.mark.parametrize(
    "block,message",
    [
        (5, "not split evenly into blocks of 5"),
        (0, r"ffn\.block = 0: must be in 1\.\.4096"),
        (32, r"field gate\.weight has shape \[64\], which does not hold a block"),
        ("x", r"ffn\.block = 'x': must be an integer"),
    ],
)
def test_bad_block(tiny, block, message):
    edit_manifest(tiny, lambda m: m["ffn"].__setitem__("block", block))
    with pytest.raises(StoreError, match=message):
        open_store(tiny)


def test_a_missing_tokenizer_is_one_line_naming_it(tiny):
    """Case 10 of the hardening probe: a missing tokenizer.json gave five lines without naming it. The
    tokenizer's files are in the manifest now; a store from before (not listing them) names it too."""
    import mlx_flash
    from mlx_flash.errors import ModelFileError

    os.remove(os.path.join(tiny, "tokenizer.json"))
    with pytest.raises(StoreError, match=r"tokenizer\.json: file listed in the manifest is missing"):
        open_store(tiny)
    edit_manifest(tiny, lambda m: m["files"].pop("tokenizer.json"))
    with pytest.raises(ModelFileError, match=r"no tokenizer\.json") as e:
        mlx_flash.load(tiny, progress=False)
    assert "\n" not in str(e.value)
