"""A service directory on flash: one folder per context, holding its record and its swapped chunks.

    <directory>/contexts/<id>/context.json    a line "MLXFCTX1 <crc32 of the rest, hex> <its bytes>",
                                              then the context as JSON: tokens, messages, owner, and
                                              per chunk the crc32 of its current swap file (null:
                                              none is current)
    <directory>/contexts/<id>/chunk-<i>.kv    chunk i: a 4 KiB header (magic, format, shape, token
                                              count, width, crc32 of the payload) then the payload
                                              [layers, 2, Hkv, C, hd]: float32, or at a compressed
                                              width its codes, scales and biases (compression.py)

Every file is written atomically (a temporary sibling, fsync, rename, fsync of the folder), so a
kill at any moment leaves either the old file or the new one. A record is used only when its
checksum matches (an edited or torn record is reported and its context dropped, never read as
something it does not say); a chunk only when its header, size and payload checksum all match what
the record says, otherwise the caller recomputes it from the tokens. This module deals in bytes and
numpy arrays only.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib

import numpy as np

from ..durable import disk_error, sync_folder, write_durably
from ..errors import DiskError
from .chunk_pool import ChunkShape
from .coded_chunks import decode, encode, packed_bytes

MAGIC = b"MLXFKV1\n"
HEADER = 4096  # the payload starts block-aligned, and files end on a block, for direct I/O
# magic, version, layers, kv_heads, head_dim, C, n_tokens, width (0: float32), crc, payload bytes
_FIELDS = struct.Struct("<8sIIIIIIIIQ")
VERSION = 2
RECORD = "context.json"
RECORD_MAGIC = b"MLXFCTX1"
_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")


class SwapError(DiskError):
    """A swap file could not be written (full disk, permissions): the chunk stays in memory."""


def check_id(ctx_id: str) -> str:
    """Context ids name folders: a plain token of URL-safe characters, nothing else."""
    if not isinstance(ctx_id, str) or not _ID.fullmatch(ctx_id):
        raise ValueError(f"context id {ctx_id!r} is malformed")
    return ctx_id


class SwapDir:
    def __init__(self, directory: str):
        self.root = os.path.join(os.path.abspath(os.path.expanduser(directory)), "contexts")
        try:
            _make_folder(self.root)
        except OSError as e:
            raise SwapError(f"service directory {directory}: cannot create it ({e.strerror})") from None

    def folder(self, ctx_id: str) -> str:
        return os.path.join(self.root, check_id(ctx_id))

    def chunk_path(self, ctx_id: str, index: int) -> str:
        return os.path.join(self.folder(ctx_id), f"chunk-{index:06d}.kv")

    # ---- records --------------------------------------------------------------------------------
    def made_folder(self, ctx_id: str) -> str:
        """The context's folder, made durably if it is new (SwapError, one line, when it cannot be)."""
        folder = self.folder(ctx_id)
        try:
            _make_folder(folder)
        except OSError as e:
            raise disk_error(SwapError, folder, e) from None
        return folder

    def write_record(self, ctx_id: str, record: dict) -> None:
        folder = self.made_folder(ctx_id)
        write_durably(os.path.join(folder, RECORD), [record_bytes(record)], SwapError, mode=0o600)

    def records(self) -> tuple[dict[str, dict], list[str]]:
        """(id -> record) of every context folder with a readable record, and one line per folder
        that has none (a context killed before its first record, or a damaged one)."""
        found, problems = {}, []
        for name in sorted(os.listdir(self.root)):
            folder = os.path.join(self.root, name)
            if not _ID.fullmatch(name) or not os.path.isdir(folder):
                continue
            _remove_temporaries(folder)
            try:
                with open(os.path.join(folder, RECORD), "rb") as f:
                    record = parse_record(f.read())
                if not isinstance(record, dict) or record.get("id") != name:
                    raise ValueError("its id does not match its folder")
                found[name] = record
            except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past Python's limit
                problems.append(f"context {name}: its record is unreadable ({type(e).__name__}: {str(e)[:120]})")
        return found, problems

    def remove(self, ctx_id: str) -> None:
        folder = self.folder(ctx_id)
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                os.unlink(os.path.join(folder, name))
            os.rmdir(folder)

    # ---- chunks ---------------------------------------------------------------------------------
    def write_chunk(
        self, ctx_id: str, index: int, shape: ChunkShape, n_tokens: int, data: np.ndarray, width: int = 0
    ) -> int:
        """Write chunk `index` (float32 [layers, 2, Hkv, C, hd]) in float32 (width 0) or quantized
        to `width` bits; returns the payload's crc32."""
        return self.write_payload(ctx_id, index, shape, n_tokens, self.payload(shape, data, width), width)

    @staticmethod
    def payload(shape: ChunkShape, data: np.ndarray, width: int) -> np.ndarray:
        """What a chunk file of float32 `data` at `width` bits holds after its header (uint8)."""
        data = np.ascontiguousarray(data, dtype=np.float32)
        if data.shape != shape.array_shape:
            raise ValueError(f"chunk of shape {data.shape} is not {shape.array_shape}")
        return np.frombuffer(encode(data, width), np.uint8) if width else data.view(np.uint8).reshape(-1)

    def write_payload(
        self, ctx_id: str, index: int, shape: ChunkShape, n_tokens: int, payload: np.ndarray, width: int
    ) -> int:
        """Write chunk `index` from its payload (payload()'s bytes, or a compressed chunk's held in
        memory); returns the payload's crc32."""
        if payload.nbytes != payload_bytes(shape, width):
            raise ValueError(f"a payload of {payload.nbytes} bytes is not a {width}-bit chunk of {shape.array_shape}")
        crc = zlib.crc32(payload)
        header = _FIELDS.pack(
            MAGIC,
            VERSION,
            shape.layers,
            shape.kv_heads,
            shape.head_dim,
            shape.tokens,
            n_tokens,
            width,
            crc,
            payload.nbytes,
        ).ljust(HEADER, b"\0")
        pad = bytes(file_bytes(shape, width) - HEADER - payload.nbytes)
        self.made_folder(ctx_id)
        write_durably(self.chunk_path(ctx_id, index), [header, memoryview(payload), pad], SwapError, mode=0o600)
        return crc

    def chunk_problem(
        self, path: str, header: bytes, payload: np.ndarray, shape: ChunkShape, n_tokens: int, width: int, crc: int
    ) -> str | None:
        """Why a chunk file read back cannot be used (None: it can): its header must say this
        format, shape, token count, width and checksum, and the payload must hash to it."""
        if len(header) < _FIELDS.size:
            return f"{path}: truncated header"
        magic, version, L, H, hd, C, n, w, hcrc, nbytes = _FIELDS.unpack_from(header)
        if magic != MAGIC or version != VERSION:
            return f"{path}: not a KV chunk file of version {VERSION}"
        if (L, H, hd, C, nbytes) != (
            shape.layers,
            shape.kv_heads,
            shape.head_dim,
            shape.tokens,
            payload_bytes(shape, width),
        ):
            return f"{path}: holds a chunk of another shape"
        if n != n_tokens or w != width or hcrc != crc:
            return f"{path}: is not the chunk the context's record names"
        if zlib.crc32(payload[:nbytes]) != crc:
            return f"{path}: checksum mismatch"
        return None


def record_bytes(record: dict) -> bytes:
    """A context record as its file holds it: the checksum line, then the JSON."""
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%s %08x %d\n" % (RECORD_MAGIC, zlib.crc32(body), len(body)) + body


def parse_record(data: bytes) -> dict:
    """A record file's JSON, once its checksum line matches the rest; ValueError saying what does not."""
    line, sep, body = data.partition(b"\n")
    fields = line.split(b" ")
    if not sep or len(fields) != 3 or fields[0] != RECORD_MAGIC:
        raise ValueError("it has no checksum line (damaged, or written by a version before checksums)")
    try:
        crc, n = int(fields[1], 16), int(fields[2])
    except ValueError:
        raise ValueError("its checksum line is malformed") from None
    if len(body) != n:
        raise ValueError(f"it holds {len(body)} bytes of JSON where its checksum line says {n} (torn or edited)")
    if zlib.crc32(body) != crc:
        raise ValueError("its checksum does not match (edited or damaged)")
    return json.loads(body)


def payload_bytes(shape: ChunkShape, width: int) -> int:
    return packed_bytes(shape.array_shape, width) if width else shape.nbytes


def file_bytes(shape: ChunkShape, width: int) -> int:
    """A chunk file's size: header and payload padded to whole 4 KiB blocks, so a direct read of the
    whole file lands straight in an aligned buffer."""
    return -(-(HEADER + payload_bytes(shape, width)) // HEADER) * HEADER


def chunk_data(payload: np.ndarray, shape: ChunkShape, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """A checked payload (uint8) as float32 [layers, 2, Hkv, C, hd] (a view of an uncompressed one's
    bytes), or written into `out`."""
    if width:
        return decode(payload, shape.array_shape, width, out)
    floats = payload[: shape.nbytes].view(np.float32).reshape(shape.array_shape)
    if out is None:
        return floats
    np.copyto(out, floats)
    return out


def _make_folder(path: str) -> None:
    """os.makedirs, then an fsync of the folder above each one it made: a record written durably into
    a new context's folder survives a power loss only if the folder's own name does (OSError as raised)."""
    made, probe = [], path
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        made.append(probe)
        probe = os.path.dirname(probe)
    if not made:
        return
    os.makedirs(path, exist_ok=True)
    for folder in reversed(made):
        sync_folder(os.path.dirname(folder))


def _remove_temporaries(folder: str) -> None:
    """Temporaries left by a writer that was killed mid-write (never the files they would replace)."""
    for name in os.listdir(folder):
        if ".tmp-" in name:
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass
