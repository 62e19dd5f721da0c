"""The tensors of a source checkpoint, read one at a time so conversion holds at most one layer.

Protocol (`SourceTensors`): canonical names; `spec(name)` gives a tensor's shape and storage dtype
without reading it; `take(name)` reads it and hands it over (the source keeps no reference, so its
memory goes when the converter drops it); `name in tensors`. Two implementations:
  ArrayTensors  a dict of lazily loaded `mx.array`s (safetensors through `mx.load`, which reads a
                tensor's bytes only when it is evaluated); `take` pops the entry
  GGUFTensors   a GGUF file read by offset (`os.preadv`), Q4_0/Q4_1/Q8_0 turned into affine
                triples block by block (gguf_blocks), the other block types (quant_spec.BLOCKS) kept
                as the file has them (uint8 rows of whole blocks); a stack of experts (a 3-D tensor, experts
                outermost) is one tensor per expert, each its own byte range of the stack
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from ..errors import ModelFileError, UnsupportedModelError
from ..quant_spec import BLOCKS, QuantSpec
from .gguf_blocks import BLOCK_TYPES, GROUP, PLAIN_TYPES, BlockValueError, affine_shapes, decode_blocks

# GGML type numbers of the block types kept as the file has them (raw rows of whole blocks).
KEPT_TYPES = {b.ggml_type: b for b in BLOCKS.values()}
SUPPORTED = "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32"

# mx dtype names (str(dtype) after "mlx.core.") that a store holds as they are.
_STORAGE = ("float32", "float16", "bfloat16", "uint32", "int32", "uint8", "int8")


def storage_dtype(mx_dtype) -> str:
    name = str(mx_dtype).rsplit(".", 1)[-1]
    if name not in _STORAGE:
        raise UnsupportedModelError(f"tensors of dtype {name} cannot be stored")
    return name


class SourceTensors:
    """Base of the protocol above; subclasses implement names, spec and take."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def spec(self, name: str) -> tuple[list[int], str]:
        raise NotImplementedError

    def take(self, name: str):
        """The tensor as an mx.array; the source holds no reference to it afterwards."""
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in self._index()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def _index(self) -> set:
        raise NotImplementedError


class ArrayTensors(SourceTensors):
    def __init__(self, arrays: dict):
        self._arrays = dict(arrays)
        self._specs = {n: (list(a.shape), storage_dtype(a.dtype)) for n, a in self._arrays.items()}

    def names(self) -> list[str]:
        return list(self._specs)

    def _index(self):
        return self._specs

    def spec(self, name):
        return self._specs[name]

    def take(self, name):
        if name not in self._arrays:
            raise KeyError(f"{name}: already taken from the source")
        return self._arrays.pop(name)


class GGUFTensors(SourceTensors):
    """header: the file's GGUF header (convert/gguf_header.py: its tensor table; gguf's reader
    serves too); rename: GGUF tensor name -> canonical name or None (unknown role); adjust:
    (canonical name, array) -> the array kept, for plain tensors an architecture stores shifted. A
    canonical name holding "{}" names a stack (a MoE layer's experts, a 3-D tensor, experts
    outermost): expert e is the tensor named with e in place of "{}", the e-th equal byte range of
    the stack, so one expert is read without the others."""

    def __init__(self, path: str, header, rename, adjust=None, parts=()):
        self.path = path
        self._adjust = adjust  # (canonical name, plain array) -> the array the store keeps, or None
        self._entries = {}  # canonical name -> (file offset, bytes, ggml type, numpy shape, part)
        self._file = {}  # canonical name -> the file it lies in (a split GGUF's part)
        self._stacks = {}  # GGUF name of a stack -> its number of experts
        unknown = []
        for file, t in [(path, t) for t in header.tensors] + [(p, t) for p, h in parts for t in h.tensors]:
            canon = rename(t.name)
            if canon is None:
                unknown.append(t.name)
                continue
            ne = [int(x) for x in t.shape]  # ne[0] is the fastest-varying axis: numpy shape reversed
            ttype = int(t.tensor_type)
            if ttype not in BLOCK_TYPES and ttype not in PLAIN_TYPES and ttype not in KEPT_TYPES:
                raise UnsupportedModelError(
                    f"{file}: tensor {t.name} has GGML type {_type_name(ttype)}; supported: {SUPPORTED}"
                )
            per_block = GROUP if ttype in BLOCK_TYPES else KEPT_TYPES[ttype].weights if ttype in KEPT_TYPES else 0
            if per_block and (not canon.endswith(".weight") or ne[0] % per_block or len(ne) < 2):
                raise ModelFileError(
                    f"{file}: tensor {t.name} is block-quantized but is not a weight matrix "
                    f"with rows a multiple of {per_block}"
                )
            for name, where in self._slices(t, canon, ne):
                if name in self._file:
                    raise ModelFileError(f"{file}: tensor {t.name} appears twice (in this file or another part)")
                self._add(name, where)
                self._file[name] = file
        if unknown:
            raise UnsupportedModelError(f"{path}: GGUF tensors with no known role: {', '.join(sorted(unknown)[:5])}")
        sizes = {f: os.path.getsize(f) for f in {path, *(p for p, _ in parts)}}
        for name, (off, n, *_rest) in self._entries.items():
            file = self._file_of(name)
            if off < 0 or n < 0 or off + n > sizes[file]:
                raise ModelFileError(f"{file}: tensor {name} lies outside the file (truncated download?)")
        self._pending: dict[str, np.ndarray] = {}  # decoded parts of the last triple not yet taken

    def _slices(self, t, canon: str, ne: list[int]):
        """(canonical name, (offset, bytes, ggml type, numpy shape)) of the tensor, or of each
        expert of a stack."""
        shape, off, n, ttype = tuple(reversed(ne)), int(t.data_offset), int(t.n_bytes), int(t.tensor_type)
        if "{}" not in canon:
            return [(canon, (off, n, ttype, shape))]
        if len(shape) != 3 or n % shape[0]:
            raise ModelFileError(
                f"{self.path}: tensor {t.name} of shape {list(ne)} is not a stack of experts "
                "(3 axes, experts outermost)"
            )
        self._stacks[t.name] = shape[0]
        per = n // shape[0]
        return [(canon.format(e), (off + e * per, per, ttype, shape[1:])) for e in range(shape[0])]

    def _add(self, name: str, where: tuple) -> None:
        """One tensor's entries: a block-quantized weight is its affine triple (three entries)."""
        if where[2] in BLOCK_TYPES:
            base = name[: -len(".weight")]
            for part in ("weight", "scales", "biases"):
                self._entries[f"{base}.{part}"] = (*where, part)
        else:
            self._entries[name] = (*where, None)

    def stacks(self) -> dict[str, int]:
        """GGUF name -> number of experts, for every stack of experts."""
        return dict(self._stacks)

    def names(self):
        return list(self._entries)

    def _index(self):
        return self._entries

    def quant_specs(self) -> dict[str, QuantSpec]:
        """Linear base name -> its quantization, for every block-quantized tensor: an affine triple
        (Q4_0, Q4_1, Q8_0) or a block type kept as stored."""
        out = {
            n[: -len(".weight")]: QuantSpec(bits=BLOCK_TYPES[e[2]].bits, group_size=GROUP)
            for n, e in self._entries.items()
            if e[4] == "weight"
        }
        out.update(
            {
                n[: -len(".weight")]: QuantSpec.block(KEPT_TYPES[e[2]].name)
                for n, e in self._entries.items()
                if e[4] is None and e[2] in KEPT_TYPES
            }
        )
        return out

    def spec(self, name):
        off, n, ttype, shape, part = self._entries[name]
        if ttype in KEPT_TYPES:  # rows of whole blocks, as the file has them
            return [*shape[:-1], KEPT_TYPES[ttype].row_bytes(shape[-1])], "uint8"
        if part is None:
            return list(shape), PLAIN_TYPES[ttype][1]
        s = affine_shapes(BLOCK_TYPES[ttype], shape[:-1], shape[-1])[part]
        return list(s), "uint32" if part == "weight" else "float16"

    def take(self, name):
        import mlx.core as mx

        a = mx.array(self.take_numpy(name))
        return a.view(mx.bfloat16) if self.spec(name)[1] == "bfloat16" else a

    def take_numpy(self, name) -> np.ndarray:
        """As take(), as a numpy array (bfloat16 as its raw uint16 words)."""
        if name in self._pending:
            return self._pending.pop(name)
        off, n, ttype, shape, part = self._entries[name]
        raw = self._read(off, n, name)
        if ttype in KEPT_TYPES:
            return raw.reshape(self.spec(name)[0])
        if part is None:
            a = raw.view(PLAIN_TYPES[ttype][0]).reshape(shape)
            return self._adjust(name, a) if self._adjust is not None else a
        try:
            parts = decode_blocks(BLOCK_TYPES[ttype], raw.reshape(*shape[:-1], -1), shape[-1])
        except BlockValueError as e:
            raise ModelFileError(f"{self._file_of(name)}: tensor {name}: {e}") from None
        base = name.rsplit(".", 1)[0]
        for p, a in parts.items():
            if p != part:
                self._pending[f"{base}.{p}"] = a
        return parts[part]

    def pop_numpy(self, name: str) -> np.ndarray:
        """A plain tensor read and removed from the source (one the converter turns into config)."""
        a = self.take_numpy(name)
        del self._entries[name], self._file[name]
        return a

    def _file_of(self, name: str) -> str:
        """The file holding tensor `name` (a triple's parts: its weight's)."""
        base, _, part = name.rpartition(".")
        return self._file.get(name) or self._file[f"{base}.weight"]

    def _read(self, off: int, n: int, name: str) -> np.ndarray:
        buf = np.empty(n, dtype=np.uint8)
        path = self._file_of(name)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [buf], off)
            finally:
                os.close(fd)
        except OSError as e:
            raise ModelFileError(f"{path}: cannot read tensor {name} ({e.strerror})") from None
        if got != n:
            raise ModelFileError(f"{path}: tensor {name} is cut short ({got} of {n} bytes; truncated download?)")
        return buf


def _type_name(ttype: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ttype).name
    except (ImportError, ValueError):
        return str(ttype)
