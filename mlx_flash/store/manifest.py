"""The store manifest: what every byte of a converted model is, and its validation.

A store directory holds `manifest.json`, one safetensors file of resident tensors, one file of FFN
row-column bundles and the tokenizer files. The manifest lists every tensor with its file, absolute
byte offset, size, shape, dtype and quantization, and every file with its size and sha256. Opening a
store validates all of it before any compute (see `validate`), so a truncated or edited store fails
with one line naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace

from ..errors import StoreError
from ..quant_spec import QuantSpec
from .consistency import check_against_config, check_block_fields, check_ffn_fields
from .schema import MANIFEST, SchemaError, check, check_config_arithmetic
from .verified import sha256_file, verify_files  # noqa: F401  (sha256_file: the converters hash with it)

FORMAT_NAME = "mlx_flash.store"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# The files a converted store holds besides the manifest: every tensor but the FFN's, and the FFN
# row-column bundles (a mixed-width MoE store replaces the latter with its own expert file).
RESIDENT_FILE = "resident.safetensors"
FFN_FILE = "ffn_bundles.bin"
# Layer regions of the bundle file start on this boundary so direct I/O can read them.
ALIGNMENT = 4096

# Storage dtypes and their item sizes. bfloat16 is kept as raw 16-bit words on the I/O side.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "uint32": 4, "int32": 4, "uint8": 1, "int8": 1}


SEAL = "seal"  # the manifest's own checksum (Manifest.to_json); manifests written before it have none


def seal_of(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, indent=1, sort_keys=True).encode()).hexdigest()


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass
class TensorEntry:
    """One stored array: `nbytes` bytes at `offset` of `file`."""

    file: str
    offset: int
    shape: list[int]
    dtype: str
    nbytes: int

    def expected_nbytes(self) -> int:
        return _prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass
class BundleField:
    """A slice of every bundle: bytes [offset, offset+nbytes) of bundle i hold this field of neuron i."""

    name: str  # "gate.weight", "gate.scales", "up.bias", "down.weight", ...
    offset: int
    dtype: str
    shape: list[int]  # per-neuron shape, e.g. [72] packed words or [576] fp16 values

    @property
    def nbytes(self) -> int:
        return _prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass
class ExpertFormat:
    """One storage format of experts in a mixed-precision MoE store (calibrate/mixed_store.py)."""

    precision: str  # "f16", "q2", "q4", "q8"
    bundle_bytes: int
    fields: list[BundleField]
    quant: dict[str, QuantSpec | None]
    down_rows: bool = False  # down kept as the [D, Fe] matrix, its arrays cut into Fe pieces (see below)


@dataclass
class FFNLayout:
    """Row-column bundles of every layer's FFN in one file.

    A bundle is the read unit: `block` consecutive neurons. With block 1 (float rows, or rows
    quantized along d_model) bundle i holds gate row i | up row i | down column i (up row | up bias |
    down column for non-gated FFNs), down columns stored as rows of the transposed matrix. When the
    source quantizes the down projection along d_ff in groups of g neurons (GGUF, mlx-community),
    block is g and a bundle holds the block's g gate rows, g up rows and the down block: the down
    matrix's [D, g] slice in its own orientation, one quantization group per d_model row, exactly as
    the source stored it (so conversion loses nothing).
    """

    file: str
    gated: bool
    n_neurons: int
    d_model: int
    bundle_bytes: int
    fields: list[BundleField]
    # Per matrix ("gate", "up", "down"): quantization of its stored rows, or None for float rows.
    quant: dict[str, QuantSpec | None]
    layer_offsets: list[int]
    precision: str  # "source" (kept as converted from the source), "f16", "q4", "q8"
    # MoE: the layer's n_neurons are n_experts runs of expert_neurons neurons (expert_rows bundles),
    # expert e first at bundle e * expert_rows, so one expert (gate | up | down of all its neurons) is
    # one contiguous read.
    n_experts: int = 0
    # Mixed-precision MoE stores: experts in several formats (`fields`/`bundle_bytes`/`quant` above
    # then describe the widest), expert_table[layer][expert] = [format index, byte offset in file].
    expert_formats: list[ExpertFormat] = field(default_factory=list)
    expert_table: list[list[list[int]]] = field(default_factory=list)
    # Whole-expert formats only: the down fields of an expert's Fe bundles, joined, are its down
    # matrix [D, Fe] in the linear's own orientation (quantized along Fe), not Fe down columns.
    down_rows: bool = False
    block: int = 1  # neurons per bundle (see above)
    # Per layer, when the matrices' quantization differs between layers (GGUF block types of a mixed
    # file, e.g. Q4_K and Q6_K down projections): that layer's `quant`; `fields` are the widest
    # type's, a narrower layer's rows padded. Empty: every layer is `quant`.
    layer_quant: list[dict[str, QuantSpec | None]] = field(default_factory=list)

    def __post_init__(self):
        if self.block < 1 or self.n_neurons % self.block:
            raise ValueError(f"ffn.n_neurons {self.n_neurons} is not split evenly into blocks of {self.block}")
        if self.n_experts < 0 or (self.n_experts and self.n_neurons % (self.n_experts * self.block)):
            raise ValueError(
                f"ffn.n_neurons {self.n_neurons} is not split evenly into {self.n_experts} experts "
                f"of whole blocks of {self.block}"
            )
        if self.down_rows and self.block != 1:
            raise ValueError("ffn.down_rows (whole-expert down matrices) needs bundles of one neuron")

    @property
    def has_blocks(self) -> bool:
        """Whether some matrix is kept in a GGUF block type (in any layer)."""
        return any(q is not None and q.is_block for quant in [self.quant, *self.layer_quant] for q in quant.values())

    def quant_of(self, layer: int) -> dict[str, QuantSpec | None]:
        """The quantization of each matrix of this layer (see layer_quant)."""
        return self.layer_quant[layer] if self.layer_quant else self.quant

    @property
    def n_rows(self) -> int:
        """Bundles per layer (the read unit)."""
        return self.n_neurons // self.block

    @property
    def layer_nbytes(self) -> int:
        return self.n_rows * self.bundle_bytes

    @property
    def expert_neurons(self) -> int:
        return self.n_neurons // self.n_experts if self.n_experts else self.n_neurons

    @property
    def expert_rows(self) -> int:
        return self.expert_neurons // self.block

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert (of the widest format in a mixed store: what a cache slot holds)."""
        return self.expert_rows * self.bundle_bytes

    def expert_offset(self, layer: int, expert: int) -> int:
        if self.expert_table:
            return self.expert_table[layer][expert][1]
        return self.layer_offsets[layer] + expert * self.expert_nbytes

    def expert_size(self, layer: int, expert: int) -> int:
        """Bytes of this expert as stored."""
        return self.expert_rows * self.expert_layout(layer, expert).bundle_bytes

    def expert_layout(self, layer: int, expert: int) -> "FFNLayout":
        """The layout to decode this expert's bundle rows with (this one unless the store is mixed)."""
        if not self.expert_table:
            return self
        f = self.expert_formats[self.expert_table[layer][expert][0]]
        return replace(
            self,
            bundle_bytes=f.bundle_bytes,
            fields=f.fields,
            quant=f.quant,
            precision=f.precision,
            expert_formats=[],
            expert_table=[],
            down_rows=f.down_rows,
        )


@dataclass
class Manifest:
    config: dict
    tensors: dict[str, TensorEntry]
    quant: dict[str, QuantSpec]  # linear name (without ".weight") -> its quantization
    ffn: FFNLayout
    files: dict[str, dict]  # file name -> {"size": int, "sha256": str}
    source: dict = field(default_factory=dict)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    # ---- serialization -------------------------------------------------------------------------
    def to_json(self) -> str:
        """The manifest as JSON, sealed: `seal` is the sha256 of the rest in this canonical form, so a
        flipped byte anywhere in the manifest is caught at open like one in the files it lists."""
        d = asdict(self)
        return json.dumps({**d, SEAL: seal_of(d)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> "Manifest":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise StoreError(f"{where}: manifest is not valid JSON ({e.msg} at line {e.lineno})") from None
        except RecursionError:
            raise StoreError(f"{where}: manifest nests deeper than any manifest does") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise StoreError(f"{where}: not an mlx_flash store manifest (format={found!r})")
        if SEAL in d:
            sealed = d.pop(SEAL)
            if sealed != seal_of(d):
                raise StoreError(
                    f"{where}: its seal does not match its content (the manifest is corrupt or was "
                    "edited; convert the model again)"
                )
        version = d.get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version != FORMAT_VERSION:
            raise StoreError(
                f"{where}: store format version {version} is not supported (this build reads version "
                f"{FORMAT_VERSION}); convert the model again"
            )
        try:
            check(MANIFEST, d)
            check_config_arithmetic(d["config"])
        except SchemaError as e:
            raise StoreError(f"{where}: manifest field {e}") from None
        try:
            ffn = d["ffn"]
            return cls(
                config=d["config"],
                tensors={k: TensorEntry(**v) for k, v in d["tensors"].items()},
                quant={k: QuantSpec(**v) for k, v in d["quant"].items()},
                ffn=FFNLayout(
                    file=ffn["file"],
                    gated=ffn["gated"],
                    n_neurons=ffn["n_neurons"],
                    d_model=ffn["d_model"],
                    bundle_bytes=ffn["bundle_bytes"],
                    fields=[BundleField(**f) for f in ffn["fields"]],
                    quant={k: (QuantSpec(**v) if v else None) for k, v in ffn["quant"].items()},
                    layer_offsets=ffn["layer_offsets"],
                    precision=ffn["precision"],
                    n_experts=int(ffn.get("n_experts", 0)),
                    expert_formats=[
                        ExpertFormat(
                            precision=x["precision"],
                            bundle_bytes=x["bundle_bytes"],
                            fields=[BundleField(**f) for f in x["fields"]],
                            quant={k: (QuantSpec(**v) if v else None) for k, v in x["quant"].items()},
                            down_rows=bool(x.get("down_rows", False)),
                        )
                        for x in ffn.get("expert_formats", [])
                    ],
                    expert_table=ffn.get("expert_table", []),
                    down_rows=bool(ffn.get("down_rows", False)),
                    block=int(ffn.get("block", 1)),
                    layer_quant=[
                        {k: (QuantSpec(**v) if v else None) for k, v in q.items()} for q in ffn.get("layer_quant", [])
                    ],
                ),
                files=d["files"],
                source=d.get("source", {}),
            )
        except StoreError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise StoreError(f"{where}: manifest is missing or mangles a required entry ({e})") from None

    # ---- validation ----------------------------------------------------------------------------
    def validate(
        self, store_dir: str, verify_checksums: bool = False, progress: bool = False, cache_dir: str | None = None
    ) -> None:
        """Check every file exists with its recorded size and every byte range is in range and
        disjoint from the others, then every file's sha256: each hashed once and stamped in
        `cache_dir` (store/verified.py), every one hashed again when `verify_checksums`."""
        root = os.path.realpath(store_dir)
        for name, info in self.files.items():
            path = os.path.join(store_dir, name)
            if os.path.dirname(os.path.realpath(path)) != root:  # a link that leaves the store
                raise StoreError(f"{path}: is a link to a file outside the store")
            if not os.path.isfile(path):
                raise StoreError(f"{path}: file listed in the manifest is missing")
            size = os.path.getsize(path)
            if size != info["size"]:
                raise StoreError(
                    f"{path}: size is {size} bytes but the manifest records {info['size']} (truncated or replaced?)"
                )
        ranges: dict[str, list[tuple[int, int, str]]] = {n: [] for n in self.files}
        for tname, t in self.tensors.items():
            self._check_range(store_dir, ranges, t.file, t.offset, t.nbytes, f"tensor {tname}")
            if t.dtype not in DTYPE_SIZES:
                raise StoreError(f"{store_dir}: tensor {tname} has unknown dtype {t.dtype!r}")
            if t.expected_nbytes() != t.nbytes:
                raise StoreError(
                    f"{store_dir}: tensor {tname} shape {t.shape} x {t.dtype} needs {t.expected_nbytes()} "
                    f"bytes but the manifest records {t.nbytes}"
                )
        f = self.ffn
        for fields, bundle_bytes in [(f.fields, f.bundle_bytes)] + [
            (x.fields, x.bundle_bytes) for x in f.expert_formats
        ]:
            end = 0
            for fl in fields:
                if fl.dtype not in DTYPE_SIZES or fl.offset < end:
                    raise StoreError(f"{store_dir}: FFN bundle field {fl.name} overlaps or has a bad dtype")
                end = fl.offset + fl.nbytes
            if end > bundle_bytes:
                raise StoreError(f"{store_dir}: FFN bundle fields need {end} bytes but bundles are {bundle_bytes}")
        for fields, quant, down_rows in [(f.fields, f.quant, f.down_rows)] + [
            (x.fields, x.quant, x.down_rows) for x in f.expert_formats
        ]:
            check_ffn_fields(store_dir, self.ffn, fields, quant, down_rows)
        check_block_fields(store_dir, self.ffn)
        if f.block > 1:  # a block's fields: [block, ...] per-neuron rows, down as [d_model, ...]
            for fl in f.fields:
                lead = f.d_model if fl.name.startswith("down.") else f.block
                if not fl.shape or fl.shape[0] != lead:
                    raise StoreError(
                        f"{store_dir}: FFN bundle field {fl.name} has shape {fl.shape}, which does not "
                        f"hold a block of {f.block} neurons (expected [{lead}, ...])"
                    )
        if len(f.layer_offsets) != self.config["num_hidden_layers"]:
            raise StoreError(
                f"{store_dir}: FFN layout lists {len(f.layer_offsets)} layers but the config has "
                f"{self.config['num_hidden_layers']}"
            )
        for layer, off in enumerate(f.layer_offsets):
            if off % ALIGNMENT:
                raise StoreError(f"{store_dir}: FFN layer {layer} region offset {off} is not {ALIGNMENT}-aligned")
            if not f.expert_table:
                self._check_range(store_dir, ranges, f.file, off, f.layer_nbytes, f"FFN layer {layer} bundles")
        if f.expert_table:
            self._check_expert_table(store_dir, ranges)
        check_against_config(store_dir, self)
        for fname, rs in ranges.items():
            rs.sort()
            for (a0, a1, an), (b0, b1, bn) in zip(rs, rs[1:]):
                if b0 < a1:
                    raise StoreError(f"{os.path.join(store_dir, fname)}: {an} and {bn} overlap at byte {b0}")
        verify_files(store_dir, self.files, cache_dir, force=verify_checksums, progress=progress)

    def _check_expert_table(self, store_dir, ranges) -> None:
        f = self.ffn
        if len(f.expert_table) != len(f.layer_offsets) or any(len(r) != f.n_experts for r in f.expert_table):
            raise StoreError(
                f"{store_dir}: the expert table does not list {f.n_experts} experts for each of "
                f"{len(f.layer_offsets)} layers"
            )
        for layer, row in enumerate(f.expert_table):
            for e, entry in enumerate(row):
                if len(entry) != 2 or not 0 <= entry[0] < len(f.expert_formats):
                    raise StoreError(f"{store_dir}: expert {e} of layer {layer} names no known format ({entry})")
                self._check_range(
                    store_dir, ranges, f.file, entry[1], f.expert_size(layer, e), f"expert {e} of layer {layer}"
                )

    def _check_range(self, store_dir, ranges, file, offset, nbytes, what):
        if file not in self.files:
            raise StoreError(f"{store_dir}: {what} lives in {file!r}, which the manifest does not list")
        size = self.files[file]["size"]
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise StoreError(
                f"{os.path.join(store_dir, file)}: {what} spans bytes {offset}..{offset + nbytes}, "
                f"past the end of the file ({size} bytes)"
            )
        ranges[file].append((offset, offset + nbytes, what))
