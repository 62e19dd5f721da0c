"""The quantization of a stored linear, shared by the store format (which records it) and the
backends (which compute with it). Plain python: neither side imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class QuantSpec:
    """Affine group quantization (MLX convention): w = q * scale + bias, groups along the last axis."""

    bits: int
    group_size: int
