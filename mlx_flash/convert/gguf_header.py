"""A GGUF header walked before gguf's reader parses it: each count and length read from the file is
checked against the bytes that follow it, so a truncated or corrupt header is one ModelFileError,
not a reader looping over a flipped count of billions of items (a hang) or reading past the end."""

from __future__ import annotations

import mmap
import os

from ..errors import ModelFileError

_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


def check_gguf_header(path: str) -> None:
    """Walk the header's counts and lengths before gguf's reader does: every one must fit in the
    file. A flipped array count would otherwise have the reader loop over billions of items (a hang)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size < 4:
            raise ModelFileError(f"{path}: not a GGUF file (shorter than its magic bytes)")
        # mapped, not read: the header is all that is walked, and a model file can be gigabytes
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _walk(path, data)


def _walk(path: str, data) -> None:
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise ModelFileError(
                f"{path}: GGUF {what} runs past the end of the file ({len(data)} bytes): truncated or corrupt"
            )
        pos += n
        return data[pos - n : pos]

    def u(n: int, what: str) -> int:
        return int.from_bytes(take(n, what), "little")

    def value(vtype: int, what: str) -> None:
        if vtype == 8:
            take(u(8, what), what)
        elif vtype == 9:
            item, count = u(4, what), u(8, what)
            if item not in _GGUF_SIZES and item != 8:
                raise ModelFileError(f"{path}: GGUF {what} is an array of unknown type {item}")
            if count * (_GGUF_SIZES.get(item) or 8) > len(data) - pos:
                raise ModelFileError(f"{path}: GGUF {what} claims {count} items, more than the file holds")
            for _ in range(count):
                value(item, what)
        elif vtype in _GGUF_SIZES:
            take(_GGUF_SIZES[vtype], what)
        else:
            raise ModelFileError(f"{path}: GGUF {what} has unknown value type {vtype}")

    if take(4, "magic") != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (bad magic bytes)")
    u(4, "version")
    n_tensors, n_kv = u(8, "tensor count"), u(8, "metadata count")
    if n_kv * 13 + n_tensors * 24 > len(data):  # the smallest entry of each
        raise ModelFileError(
            f"{path}: GGUF header claims {n_kv} metadata and {n_tensors} tensor entries, more than the file holds"
        )
    for i in range(n_kv):
        key = take(u(8, f"metadata key {i}"), f"metadata key {i}").decode("utf-8", "replace")
        value(u(4, f"metadata {key[:60]}"), f"metadata {key[:60]}")
    for i in range(n_tensors):
        take(u(8, f"tensor name {i}"), f"tensor name {i}")
        dims = u(4, f"tensor {i}")
        if dims > 8:
            raise ModelFileError(f"{path}: GGUF tensor {i} has {dims} dimensions")
        take(8 * dims + 12, f"tensor {i}")
