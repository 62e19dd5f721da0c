"""Activation-sparsity thresholds (TEAL): for every layer and every product's input, the magnitude at
or below which an input channel is treated as zero, so the product skips that channel's weights.

Inputs that feed more than one matrix share one threshold: q, k and v read the same normed residual
(the graph multiplies them as one fused `qkv` product), gate and up read the same FFN input
(`gate_up`); `o` reads the attention output and `down` the FFN's activations. Thresholds are set
offline on calibration text (calibrate/thresholds.py): for each (layer, input) the quantiles of |x|
at every whole percent, so a level of sparsity s takes each input's s-quantile: every product, and
so the model as a whole, zeroes the share s of its inputs on text like the calibration's.

The file lies beside the store's manifest (`sparsity-thresholds.json`), names the store it was
measured on (the sha256 of every file the manifest lists), carries its own checksum, and is written
durably; a file of another store, truncated or altered is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from ..config import MAX_SPARSITY
from ..durable import write_durably
from ..errors import ConfigError, StoreError
from ..store.atomic_dir import OutputError

FILE_NAME = "sparsity-thresholds.json"
FORMAT = "mlx_flash sparsity thresholds"
VERSION = 1
ROLES = ("qkv", "o", "gate_up", "down")  # the inputs thresholded, in the graph's order within a layer
PERCENTS = 100  # quantiles at 0, 1, ..., 99 percent


def store_fingerprint(store) -> str:
    """What names a store's contents: the sha256 of its files' own sha256s, as its manifest lists them."""
    files = {name: meta["sha256"] for name, meta in sorted(store.manifest.files.items())}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def thresholds_path(store) -> str:
    return os.path.join(store.path, FILE_NAME)


@dataclass
class Thresholds:
    """Quantiles of |x| per input: quantiles[role] float32 [layers, PERCENTS], where column p is the
    magnitude below which p% of that input's channels fall on the calibration text."""

    quantiles: dict[str, np.ndarray]
    store: str  # store_fingerprint of the store they were measured on
    calibration: dict  # corpus, tokens, context: how they were measured
    # How a model-wide level is shared among the inputs (calibrate/thresholds.py's greedy search):
    # points [model-wide level, {role: its level}] from all-dense upwards, the model-wide level being
    # the parameter-weighted mean of the roles'. Empty: every input at the model-wide level.
    allocation: list = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        return int(next(iter(self.quantiles.values())).shape[0])

    def role_levels(self, sparsity: float) -> dict[str, float]:
        """Each input's level for a model-wide `sparsity`: along the allocation's points (linear
        between two), every input at `sparsity` past its last point or without one."""
        if not 0.0 <= sparsity <= MAX_SPARSITY:
            raise ConfigError(f"sparsity {sparsity:g} is outside [0, {MAX_SPARSITY}]")
        points = self.allocation
        if not points or sparsity >= points[-1][0]:
            last = points[-1][1] if points else {}
            return {r: max(sparsity, last.get(r, 0.0)) for r in ROLES}
        for (a, la), (b, lb) in zip(points, points[1:]):
            if a <= sparsity <= b:
                f = 0.0 if b == a else (sparsity - a) / (b - a)
                return {r: la[r] + (lb[r] - la[r]) * f for r in ROLES}
        return {r: sparsity for r in ROLES}  # below the first point (it is 0: not reached)

    def at(self, sparsity: float) -> dict[str, np.ndarray]:
        """Per role, each layer's threshold for a model-wide `sparsity` (a share of inputs in
        [0, MAX_SPARSITY]): the quantile at that role's level, linear between whole percents."""
        out = {}
        for r, level in self.role_levels(sparsity).items():
            q, p = self.quantiles[r], min(level, MAX_SPARSITY) * 100.0
            lo = min(int(np.floor(p)), PERCENTS - 1)
            hi, frac = min(lo + 1, PERCENTS - 1), np.float32(p - lo)
            out[r] = (q[:, lo] * (1 - frac) + q[:, hi] * frac).astype(np.float32)
        return out

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "store": self.store,
            "calibration": self.calibration,
            "quantiles": {r: self.quantiles[r].tolist() for r in ROLES},
            "allocation": self.allocation,
        }
        text = json.dumps(body, sort_keys=True)
        return json.dumps({**body, "checksum": hashlib.sha256(text.encode()).hexdigest()}, sort_keys=True).encode()


def save_thresholds(store, thresholds: Thresholds) -> str:
    """Write the thresholds beside the store's manifest, durably; returns the path."""
    path = thresholds_path(store)
    write_durably(path, [thresholds.to_json()], OutputError)
    return path


def load_thresholds(store, n_layers: int, flags: str = "") -> Thresholds:
    """The store's thresholds, checked: present, whole (checksum), of this store (fingerprint), one
    row per layer for every role, finite and non-decreasing along the percents. `flags`: what the
    command that makes them needs for this store, for the refusal's advice."""
    path = thresholds_path(store)
    command = f"python -m mlx_flash.sparsify MODEL{' ' + flags if flags else ''}"
    if not os.path.isfile(path):
        raise StoreError(
            f"{store.path}: the store has no sparsity thresholds (make them with {command}, or "
            "mlx_flash.sparsity_thresholds)"
        )

    def _refuse(path: str, why: str) -> StoreError:
        return StoreError(f"{path}: {why}; make them again with {command}")

    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
        checksum = d.pop("checksum")
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise _refuse(path, f"the thresholds file is unreadable ({type(e).__name__})") from None
    if hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest() != checksum:
        raise _refuse(path, "the thresholds file's checksum does not match its contents (altered or damaged)")
    if d.get("format") != FORMAT or d.get("version") != VERSION:
        raise _refuse(path, f"not a thresholds file of version {VERSION}")
    if d.get("store") != store_fingerprint(store):
        raise _refuse(path, "the thresholds were measured on another store (another model or conversion)")
    quantiles = {}
    for r in ROLES:
        try:
            q = np.asarray(d["quantiles"][r], dtype=np.float32)
        except (KeyError, TypeError, ValueError):
            raise _refuse(path, f"input {r!r} has no thresholds") from None
        if q.shape != (n_layers, PERCENTS):
            raise _refuse(path, f"input {r!r} has thresholds of shape {list(q.shape)}, not [{n_layers}, {PERCENTS}]")
        if not np.all(np.isfinite(q)) or np.any(np.diff(q, axis=1) < 0) or np.any(q < 0):
            raise _refuse(path, f"input {r!r} has thresholds that are not finite, non-negative and increasing")
        quantiles[r] = q
    allocation = d.get("allocation") or []
    try:
        ok = all(0 <= float(a) <= 1 and all(0 <= float(lv[r]) <= 1 for r in ROLES) for a, lv in allocation) and all(
            p[0] <= q[0] for p, q in zip(allocation, allocation[1:])
        )
    except (TypeError, ValueError, KeyError):
        ok = False
    if not ok:
        raise _refuse(path, "its allocation is not a rising list of [level, {input: level}] points")
    return Thresholds(quantiles, d["store"], dict(d.get("calibration") or {}), allocation)
