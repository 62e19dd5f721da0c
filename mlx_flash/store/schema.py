"""The manifest's schema: every field's type, sign and range, checked on the parsed JSON before any
arithmetic uses it (a store is a trust boundary: someone may hand you an edited one).

A schema is built from a few checkers (`Int`, `Num`, `Str`, `Bool`, `OneOf`, `Name`, `ListOf`,
`MapOf`, `Obj`, `Maybe`); `check(schema, value, path)` raises SchemaError naming the field's path
(`ffn.fields[2].offset`), the value and what is wrong with it. File names are plain names inside
the store: no separator, no `..`, nothing absolute (`Name`); where they point is checked again at
open, where links are resolved (store/manifest.py).

Ranges are the sizes an engine can hold on one machine, far above any real model, so that an
edited count cannot reach arithmetic that crashes the process (a zero divisor, a billion heads).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..quant_spec import BLOCKS

BIG = 1 << 50  # bytes and offsets: a petabyte
DIM = 1 << 24  # widths, counts of neurons, vocabulary
COUNT = 1 << 16  # layers, heads, experts


class SchemaError(ValueError):
    def __init__(self, path: str, value, problem: str):
        shown = repr(value)
        super().__init__(f"{path} = {shown if len(shown) <= 60 else shown[:57] + '...'}: {problem}")


class Checker:
    def check(self, value, path: str) -> None:
        raise NotImplementedError


@dataclass
class Int(Checker):
    lo: int = 0
    hi: int = BIG

    def check(self, value, path):
        if not isinstance(value, int) or isinstance(value, bool):
            raise SchemaError(path, value, "must be an integer")
        if not self.lo <= value <= self.hi:
            raise SchemaError(path, value, f"must be in {self.lo}..{self.hi}")


@dataclass
class Num(Checker):
    lo: float = -math.inf
    hi: float = math.inf
    open_lo: bool = False  # lo itself excluded

    def check(self, value, path):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise SchemaError(path, value, "must be a finite number")
        if value < self.lo or (self.open_lo and value == self.lo) or value > self.hi:
            raise SchemaError(
                path,
                value,
                f"must be {'above' if self.open_lo else 'at least'} {self.lo}"
                + (f" and at most {self.hi}" if self.hi < math.inf else ""),
            )


class Str(Checker):
    def check(self, value, path):
        if not isinstance(value, str):
            raise SchemaError(path, value, "must be a string")


class Bool(Checker):
    def check(self, value, path):
        if not isinstance(value, bool):
            raise SchemaError(path, value, "must be true or false")


@dataclass
class OneOf(Checker):
    values: tuple

    def check(self, value, path):
        if isinstance(value, bool) or value not in self.values:
            raise SchemaError(path, value, f"must be one of {', '.join(map(repr, self.values))}")


class Name(Checker):
    """A plain file name inside the store directory."""

    def check(self, value, path):
        Str().check(value, path)
        if not value or value in (".", "..") or "/" in value or "\\" in value or "\0" in value or ":" in value:
            raise SchemaError(path, value, "must be a plain file name inside the store (no separators, no '..')")


@dataclass
class Hex(Checker):
    length: int

    def check(self, value, path):
        if not isinstance(value, str) or not re.fullmatch(f"[0-9a-f]{{{self.length}}}", value):
            raise SchemaError(path, value, f"must be {self.length} lowercase hex digits")


@dataclass
class ListOf(Checker):
    item: Checker
    max_len: int = BIG
    min_len: int = 0

    def check(self, value, path):
        if not isinstance(value, list):
            raise SchemaError(path, value, "must be a list")
        if not self.min_len <= len(value) <= self.max_len:
            raise SchemaError(path, value, f"must hold {self.min_len}..{self.max_len} items")
        for i, v in enumerate(value):
            self.item.check(v, f"{path}[{i}]")


@dataclass
class MapOf(Checker):
    item: Checker
    key: Checker = field(default_factory=Str)

    def check(self, value, path):
        if not isinstance(value, dict):
            raise SchemaError(path, value, "must be an object")
        for k, v in value.items():
            self.key.check(k, f"{path} key")
            self.item.check(v, f"{path}[{k!r}]")


@dataclass
class Either(Checker):
    """One of two forms (a token id or a list of them)."""

    first: Checker
    second: Checker

    def check(self, value, path):
        try:
            self.first.check(value, path)
        except SchemaError:
            self.second.check(value, path)


@dataclass
class Maybe(Checker):
    inner: Checker

    def check(self, value, path):
        if value is not None:
            self.inner.check(value, path)


@dataclass
class Obj(Checker):
    required: dict
    optional: dict = field(default_factory=dict)
    open: bool = False  # other keys allowed (checked by nothing)

    def check(self, value, path):
        if not isinstance(value, dict):
            raise SchemaError(path, value, "must be an object")
        for k, c in self.required.items():
            if k not in value:
                raise SchemaError(f"{path}.{k}" if path else k, None, "is missing")
            c.check(value[k], f"{path}.{k}" if path else k)
        for k, c in self.optional.items():
            if k in value:
                c.check(value[k], f"{path}.{k}" if path else k)
        if not self.open:
            extra = sorted(set(value) - set(self.required) - set(self.optional))
            if extra:
                raise SchemaError(f"{path}.{extra[0]}" if path else extra[0], value[extra[0]], "is not a field of it")


def check(schema: Checker, value, path: str = "") -> None:
    schema.check(value, path)


# ---- the manifest ------------------------------------------------------------------------------------

DTYPES = ("float32", "float16", "bfloat16", "uint32", "int32", "uint8", "int8")
SHAPE = ListOf(Int(0, BIG), max_len=8)
QUANT = Obj(
    {"bits": OneOf((0, 2, 3, 4, 5, 6, 8)), "group_size": OneOf((16, 32, 64, 128, 256))},
    {"kind": Maybe(OneOf(tuple(BLOCKS)))},
)  # (QuantSpec checks that bits and kind agree)
FIELD = Obj({"name": Str(), "offset": Int(0, BIG), "dtype": OneOf(DTYPES), "shape": ListOf(Int(1, DIM), 8, 1)})
EXPERT_FORMAT = Obj(
    {"precision": Str(), "bundle_bytes": Int(1, BIG), "fields": ListOf(FIELD, 1 << 10), "quant": MapOf(Maybe(QUANT))},
    {"down_rows": Bool()},
)
FFN = Obj(
    {
        "file": Name(),
        "gated": Bool(),
        "n_neurons": Int(1, DIM),
        "d_model": Int(1, DIM),
        "bundle_bytes": Int(1, BIG),
        "fields": ListOf(FIELD, 1 << 10, 1),
        "quant": MapOf(Maybe(QUANT)),
        "layer_offsets": ListOf(Int(0, BIG), COUNT, 1),
        "precision": Str(),
    },
    {
        "n_experts": Int(0, COUNT),
        "expert_formats": ListOf(EXPERT_FORMAT, 64),
        "expert_table": ListOf(ListOf(ListOf(Int(0, BIG), 2, 2), COUNT), COUNT),
        "down_rows": Bool(),
        "block": Int(1, 1 << 12),
        "layer_quant": ListOf(MapOf(Maybe(QUANT)), COUNT),
    },
)
# The normalized config every family writes (models/*.normalize_config): what the graphs and the
# planners compute with. Other keys of a family are checked by its own ModelArgs.
CONFIG = Obj(
    {
        "model_type": Str(),
        "hidden_size": Int(1, DIM),
        "num_hidden_layers": Int(1, COUNT),
        "num_attention_heads": Int(1, COUNT),
        "vocab_size": Int(1, DIM),
    },
    {
        "intermediate_size": Int(1, DIM),
        "ffn_dim": Int(1, DIM),
        "num_key_value_heads": Int(1, COUNT),
        "head_dim": Int(1, 1 << 14),
        "rms_norm_eps": Num(0, 1, open_lo=True),
        "layer_norm_eps": Num(0, 1, open_lo=True),
        "rope_theta": Num(0, open_lo=True),
        "rope_scale": Num(0, open_lo=True),
        "max_position_embeddings": Int(1, 1 << 26),
        "num_experts": Int(1, COUNT),
        "num_experts_per_tok": Int(1, COUNT),
        "moe_intermediate_size": Int(1, DIM),
        "shared_expert_intermediate_size": Int(0, DIM),
        "word_embed_proj_dim": Int(1, DIM),
        "sliding_window": Maybe(Int(1, 1 << 26)),
        "tie_word_embeddings": Bool(),
        "rope_traditional": Bool(),
        "bos_token_id": Maybe(Either(Int(0, DIM), ListOf(Int(0, DIM), 64))),
        "eos_token_id": Maybe(Either(Int(0, DIM), ListOf(Int(0, DIM), 64))),
        # RoPE scalings (models/rope.py) and Gemma 3's layer kinds, windows and scales (models/gemma3_text.py)
        "rope_scaling": Maybe(
            Obj(
                {"rope_type": OneOf(("llama3", "yarn", "factors"))},
                {
                    "factor": Num(1, 1 << 20),
                    "low_freq_factor": Num(0, 1 << 20, open_lo=True),
                    "high_freq_factor": Num(0, 1 << 20, open_lo=True),
                    "original_max_position_embeddings": Num(1, 1 << 26),
                    "beta_fast": Num(0, 1e6, open_lo=True),
                    "beta_slow": Num(0, 1e6, open_lo=True),
                    "mscale": Num(0, 1e6),
                    "mscale_all_dim": Num(0, 1e6),
                    "attention_factor": Num(0, 1e6, open_lo=True),
                    "truncate": Bool(),
                    "factors": ListOf(Num(0, 1e9, open_lo=True), 1 << 14),
                },
            )
        ),
        "layer_types": ListOf(OneOf(("sliding_attention", "full_attention")), COUNT),
        "window": Int(1, 1 << 26),
        "rope_local_theta": Num(0, open_lo=True),
        "query_pre_attn_scalar": Num(0, 1 << 30, open_lo=True),
    },
    open=True,
)
MANIFEST = Obj(
    {
        "format": Str(),
        "format_version": Int(0, 1 << 20),
        "config": CONFIG,
        "tensors": MapOf(
            Obj({"file": Name(), "offset": Int(0, BIG), "shape": SHAPE, "dtype": OneOf(DTYPES), "nbytes": Int(0, BIG)})
        ),
        "quant": MapOf(QUANT),
        "ffn": FFN,
        "files": MapOf(Obj({"size": Int(0, BIG), "sha256": Hex(64)}), key=Name()),
    },
    {"source": Obj({}, open=True)},
)  # where the store came from: shown, never computed with


# Keys the families' ModelArgs take without a default (models/*.py; OPT's: ffn_dim). Every family's
# normalize_config writes them, so a store without one was edited; listed here because store/
# imports no model code (tests/test_layering.py).
FAMILY_REQUIRED = ("intermediate_size", "num_key_value_heads", "head_dim")


def check_config_arithmetic(config: dict, path: str = "config") -> None:
    """The keys the family's arguments need (FAMILY_REQUIRED), and what the graphs divide by: heads
    must split the width (unless head_dim is given) and the kv heads must split the heads."""
    for key in ("ffn_dim",) if config["model_type"] == "opt" else FAMILY_REQUIRED:
        if key not in config:
            raise SchemaError(f"{path}.{key}", None, f"is missing (a {config['model_type']} model needs it)")
    heads = config["num_attention_heads"]
    if "head_dim" not in config and config["hidden_size"] % heads:
        raise SchemaError(
            f"{path}.num_attention_heads",
            heads,
            f"must divide hidden_size {config['hidden_size']} (no head_dim is given)",
        )
    kv = config.get("num_key_value_heads", heads)
    if heads % kv:
        raise SchemaError(f"{path}.num_key_value_heads", kv, f"must divide num_attention_heads {heads}")
    types = config.get("layer_types")
    if types is not None and len(types) != config["num_hidden_layers"]:
        raise SchemaError(f"{path}.layer_types", types, f"must name each of the {config['num_hidden_layers']} layers")
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise SchemaError(f"{path}.rope_scaling.{key}", None, "is missing (llama3 scaling needs it)")
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise SchemaError(
                f"{path}.rope_scaling.high_freq_factor",
                scaling["high_freq_factor"],
                f"must be above low_freq_factor {scaling['low_freq_factor']}",
            )
    if config.get("num_experts_per_tok", 0) > config.get("num_experts", COUNT):
        raise SchemaError(
            f"{path}.num_experts_per_tok",
            config["num_experts_per_tok"],
            f"must be at most num_experts {config['num_experts']}",
        )
