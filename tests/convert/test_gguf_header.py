"""convert/gguf_header.py against its reference, gguf's own reader: the same metadata values (of the
same Python types), value types, tensor table (names, shapes, GGML types, absolute offsets, sizes)
and data offset, on the default model's GGUF (a 49k-token vocabulary) and on the tiny llama GGUF the
fuzz tests build (Q4_0, Q8_0, F16 and F32 tensors, bool and array metadata)."""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf")

from mlx_flash.convert.gguf_header import read_gguf_header  # noqa: E402
from mlx_flash.errors import ModelFileError  # noqa: E402
from test_fuzz_gguf import write_tiny_gguf  # noqa: E402


def assert_same_as_the_reader(path: str) -> None:
    ours, ref = read_gguf_header(path), gguf.GGUFReader(path)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # the reader's own entries
    assert list(ours.fields) == list(ref_fields)
    for key, f in ref_fields.items():
        got, want = ours.fields[key], f.contents()
        assert got.value == want and type(got.value) is type(want), key
        if isinstance(want, list):
            assert [type(v) for v in got.value] == [type(v) for v in want], key
            assert (got.vtype, got.item_type, got.count) == (f.types[0], f.types[-1], len(f.data)), key
        else:
            assert got.vtype == f.types[0], key
    assert ours.data_offset == ref.data_offset
    assert [(t.name, t.shape, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, tuple(int(x) for x in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in ref.tensors
    ]


def test_the_default_gguf_reads_as_ggufs_reader_reads_it(default_gguf):
    assert_same_as_the_reader(default_gguf)


def test_a_tiny_gguf_of_four_tensor_types_reads_as_ggufs_reader_reads_it(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path)
    header = read_gguf_header(path)
    assert {t.tensor_type for t in header.tensors} >= {0, 1, 2, 8}  # F32, F16, Q4_0, Q8_0
    assert_same_as_the_reader(path)


def test_a_header_cut_short_or_with_a_tensor_past_the_end_is_one_line(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path)
    data = open(path, "rb").read()
    end = read_gguf_header(path).data_offset
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: end // 2])
    with pytest.raises(ModelFileError, match=r"cut\.gguf: GGUF .*(runs past the end of|more than) the file"):
        read_gguf_header(str(cut))
    cut.write_bytes(data[: end + 8])  # the header whole, the tensor data not
    with pytest.raises(ModelFileError, match=r"cut\.gguf: unreadable GGUF .*past the end of the file"):
        read_gguf_header(str(cut))
