"""A GGUF file's header read in one checked walk: its metadata values, its tensor table and where the
tensor data begins. Every count and length read from the file is checked against the bytes that
follow it, so a truncated or corrupt header is one ModelFileError, not a loop over a flipped count of
billions of items (a hang) or a read past the end. Only the header is read (the file is mapped, not
read whole); tensor data is never touched.

gguf's own reader builds a numpy view for every item of every array (about 6 s for a 49k-token
vocabulary, paid at each open); this walk decodes the same values, as plain Python values of the
same types, in a fraction of that."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import ModelFileError

STRING, ARRAY = 8, 9  # GGUF value types (gguf.GGUFValueType's numbers) that are not fixed-size scalars
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_VERSIONS = (2, 3)
_ALIGNMENT = 32  # GGUF's default, unless general.alignment says otherwise


@dataclass(frozen=True)
class GGUFField:
    value: object  # int, float, bool, str, or a list of one of them
    vtype: int  # the GGUF value type
    item_type: int | None = None  # an array's item type
    count: int = 1  # an array's items


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF's ne: the fastest-varying axis first
    tensor_type: int  # the GGML type
    data_offset: int  # where its bytes begin in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, GGUFField]
    tensors: list[GGUFTensorInfo]
    data_offset: int  # where the tensor data begins (the header's end, aligned)


def read_gguf_header(path: str) -> GGUFHeader:
    """The header of the GGUF at `path`, checked; one ModelFileError line naming what is wrong."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 4:
            raise ModelFileError(f"{path}: not a GGUF file (shorter than its magic bytes)")
        # mapped, not read: the header is all that is walked, and a model file can be gigabytes
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Walk(path, data).header()


class _Walk:
    def __init__(self, path: str, data):
        self.path, self.data, self.pos = path, data, 0

    def fail(self, why: str):
        raise ModelFileError(f"{self.path}: {why}")

    def take(self, n: int, what: str) -> int:
        """The position of the next n bytes, which must lie in the file; moves past them."""
        if n < 0 or self.pos + n > len(self.data):
            self.fail(f"GGUF {what} runs past the end of the file ({len(self.data)} bytes): truncated or corrupt")
        self.pos += n
        return self.pos - n

    def scalar(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

    def text(self, what: str) -> str:
        n = self.scalar("<Q", what)
        at = self.take(n, what)
        try:
            return self.data[at : at + n].decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"GGUF {what} is not UTF-8 text")

    def value(self, vtype: int, what: str) -> GGUFField:
        if vtype == STRING:
            return GGUFField(self.text(what), vtype)
        if vtype == ARRAY:
            item, count = self.scalar("<I", what), self.scalar("<Q", what)
            if item == STRING:
                if count * 8 > len(self.data) - self.pos:  # each string's length alone takes 8 bytes
                    self.fail(f"GGUF {what} claims {count} items, more than the file holds")
                return GGUFField([self.text(what) for _ in range(count)], vtype, item, count)
            if item not in _SCALARS:
                self.fail(f"GGUF {what} is an array of unknown type {item}")
            width = struct.calcsize(_SCALARS[item])
            if count * width > len(self.data) - self.pos:
                self.fail(f"GGUF {what} claims {count} items, more than the file holds")
            at = self.take(count * width, what)
            items = np.frombuffer(self.data, np.dtype(_SCALARS[item]), count, at).tolist()
            return GGUFField(items, vtype, item, count)
        if vtype not in _SCALARS:
            self.fail(f"GGUF {what} has unknown value type {vtype}")
        return GGUFField(self.scalar(_SCALARS[vtype], what), vtype)

    def header(self) -> GGUFHeader:
        if self.data[0:4] != b"GGUF":
            self.fail("not a GGUF file (bad magic bytes)")
        self.pos = 4
        version = self.scalar("<I", "version")
        if version not in _VERSIONS:
            big_endian = version & 0xFFFF == 0
            self.fail(
                "a big-endian GGUF, not supported"
                if big_endian
                else f"GGUF version {version}, not supported (versions {', '.join(map(str, _VERSIONS))})"
            )
        n_tensors, n_kv = self.scalar("<Q", "tensor count"), self.scalar("<Q", "metadata count")
        if n_kv * 13 + n_tensors * 24 > len(self.data):  # the smallest entry of each
            self.fail(f"GGUF header claims {n_kv} metadata and {n_tensors} tensor entries, more than the file holds")
        fields: dict[str, GGUFField] = {}
        for i in range(n_kv):
            key = self.text(f"metadata key {i}")
            if key in fields:
                self.fail(f"GGUF metadata {key[:60]} appears twice")
            fields[key] = self.value(self.scalar("<I", f"metadata {key[:60]}"), f"metadata {key[:60]}")
        entries = [self.tensor_entry(i) for i in range(n_tensors)]
        align = fields.get("general.alignment", GGUFField(_ALIGNMENT, 4))
        if align.vtype != 4 or align.value < 1 or align.value & (align.value - 1):
            self.fail(f"GGUF general.alignment {str(align.value)[:20]} is not a power of two (uint32)")
        data_offset = -(-self.pos // align.value) * align.value
        return GGUFHeader(fields, self.tensors(entries, data_offset), data_offset)

    def tensor_entry(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = self.text(f"tensor name {i}")
        dims = self.scalar("<I", f"tensor {i}")
        if dims > 8:
            self.fail(f"GGUF tensor {i} has {dims} dimensions")
        at = self.take(8 * dims + 12, f"tensor {i}")
        shape = struct.unpack_from(f"<{dims}Q", self.data, at)
        ttype, offset = struct.unpack_from("<IQ", self.data, at + 8 * dims)
        return name, shape, ttype, offset

    def tensors(self, entries, data_offset: int) -> list[GGUFTensorInfo]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        out, seen = [], set()
        for name, shape, ttype, offset in entries:
            if name in seen:
                self.fail(f"GGUF tensor {name[:60]} appears twice")
            seen.add(name)
            try:
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                self.fail(f"unreadable GGUF (tensor {name[:60]} has unknown GGML type {ttype})")
            n_bytes = int(np.prod(shape, dtype=object)) * type_bytes // block
            if data_offset + offset + n_bytes > len(self.data):
                self.fail("unreadable GGUF (a tensor's data lies past the end of the file: truncated download?)")
            out.append(GGUFTensorInfo(name, shape, ttype, data_offset + offset, n_bytes))
        return out
