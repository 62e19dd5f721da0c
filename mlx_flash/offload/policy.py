"""A throughput policy (FlexGen §4.3): how big a block is and where its bytes live, as one typed
value. The search (offload/search.py) prints one; `python -m mlx_flash.batch --policy` takes the
same fields as JSON for experiments.

Two tiers on this platform: compute memory (inside the process's memory limit) and flash. Weights
are placed by layer: the first `resident_layers` layers' FFNs stay in memory as stored, the rest are
read once per layer and step (once per micro-batch in the row order). KV caches stay in memory, at
float or (`kv_bits` 4) group-wise 4-bit, except the last `kv_on_flash` micro-batches' (exact KV),
which live in files on flash between their turns (offload/kv_spill.py). `attention_keep` below 1
is top-k sparse attention (offload/sparse_attention.py), an approximation. Activations of a block
(its hidden states between layers) always stay in memory: they are a few rows per sequence.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from ..errors import ConfigError
from ..batching.schedule import Order

KV_BITS = (0, 4)  # 0: the activation dtype (exact)
KV_GROUP = 64  # values: a scale and bias per this many channels of a token
KEY_BLOCK = 16  # keys: a scale and bias per channel and this many tokens


@dataclass(frozen=True)
class Policy:
    gpu_batch: int = 1  # rows of one micro-batch (one batched call of a layer)
    num_batches: int = 1  # micro-batches of a block; a block is gpu_batch x num_batches sequences
    resident_layers: int = 0  # layers whose FFN stays in memory; the rest are read from flash
    kv_bits: int = 0  # KV cache: 0 exact, 4 group-wise 4-bit (an approximation)
    order: Order = Order.ZIGZAG
    overlap: bool = True  # read the next layer while computing this one
    kv_on_flash: int = 0  # micro-batches of a block whose KV is on flash between their turns
    attention_keep: float = 1.0  # top-k sparse attention: each query's top share of keys (1.0: exact)

    def __post_init__(self):
        if self.gpu_batch < 1 or self.num_batches < 1:
            raise ConfigError(
                f"policy: gpu_batch and num_batches must be >= 1 (got {self.gpu_batch}, {self.num_batches})"
            )
        if self.resident_layers < 0:
            raise ConfigError(f"policy: resident_layers must be >= 0 (got {self.resident_layers})")
        if self.kv_bits not in KV_BITS:
            raise ConfigError(f"policy: kv_bits must be one of {KV_BITS} (got {self.kv_bits})")
        if not 0 <= self.kv_on_flash <= self.num_batches:
            raise ConfigError(
                f"policy: kv_on_flash must be in 0..num_batches={self.num_batches} (got {self.kv_on_flash})"
            )
        if self.kv_on_flash and self.kv_bits:
            raise ConfigError("policy: KV on flash is kept exact; kv_on_flash needs kv_bits 0")
        if not 0.0 < self.attention_keep <= 1.0:
            raise ConfigError(f"policy: attention_keep must be in (0, 1] (got {self.attention_keep})")
        if not isinstance(self.order, Order):
            raise ConfigError(f"policy: order must be an Order (got {self.order!r})")

    @property
    def block_size(self) -> int:
        return self.gpu_batch * self.num_batches

    def on_flash(self, k: int) -> bool:
        """Whether sequence k of a block (micro-batch k // gpu_batch) keeps its KV on flash."""
        return k >= (self.num_batches - self.kv_on_flash) * self.gpu_batch

    def check(self, n_layers: int) -> "Policy":
        """Refuse a placement of more layers than the model has."""
        if self.resident_layers > n_layers:
            raise ConfigError(f"policy: resident_layers must be in 0..{n_layers} (got {self.resident_layers})")
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["order"] = self.order.value
        return d

    def __str__(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Policy":
        """A policy from JSON with the fields `to_dict` prints (any left out keep their defaults)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"policy: not JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(d, dict):
            raise ConfigError("policy: expected a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"policy: unknown field(s) {', '.join(unknown)} (fields: {', '.join(known)})")
        out = {}
        for k, v in d.items():
            if k == "order":
                try:
                    out[k] = Order(v)
                except ValueError:
                    raise ConfigError(f"policy: order must be one of {[o.value for o in Order]} (got {v!r})") from None
            elif k == "attention_keep":
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise ConfigError(f"policy: attention_keep must be a number (got {v!r})")
                out[k] = float(v)
            elif k == "overlap":
                if not isinstance(v, bool):
                    raise ConfigError(f"policy: overlap must be true or false (got {v!r})")
                out[k] = v
            else:
                if not isinstance(v, int) or isinstance(v, bool):
                    raise ConfigError(f"policy: {k} must be an integer (got {v!r})")
                out[k] = v
        return cls(**out)
