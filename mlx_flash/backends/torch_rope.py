"""Rotary position embedding with torch's own ops (CUDA, and torch's bfloat16 mode on a CPU; with the
CPU kernel the backend calls its rope operator instead): rotations as complex multiplications by a
table of exp(i * position * frequency), kept per model shape."""

from __future__ import annotations

import numpy as np

try:
    import torch
except ImportError:  # the torch backend says what to install (TorchOps refuses to start without it)
    torch = None


class RopeTables:
    def __init__(self):
        self._tables: dict = {}

    def rope(self, x, dims: int, traditional: bool, base: float, offset, scale: float = 1.0, freqs=None):
        """mx.fast.rope's semantics (TorchOps.rope)."""
        T = x.shape[-2]
        if isinstance(offset, np.ndarray):
            tab = self.table(dims, base, scale, int(offset.max()) + T, x.device, freqs)
            rot = tab[torch.from_numpy(offset[:, None] + np.arange(T)).to(x.device)][:, None]  # [B, 1, T, dims/2]
        else:
            rot = self.table(dims, base, scale, offset + T, x.device, freqs)[offset : offset + T]  # [T, dims/2]
        xr, rest = x[..., :dims], x[..., dims:]
        if traditional:  # pairs (0,1), (2,3), ... are (real, imag) of one complex number
            z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], dims // 2, 2).contiguous())
            out = torch.view_as_real(z * rot).flatten(-2)
        else:  # halves (0, dims/2), ...
            cos, sin = rot.real, rot.imag
            x1, x2 = xr[..., : dims // 2], xr[..., dims // 2 :]
            out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def table(self, dims, base, scale, length, device, freqs=None):
        """exp(i * position * freq) [positions, dims/2], computed in float64 once, grown by doubling."""
        key = (dims, base, scale, device, None if freqs is None else freqs.tobytes())
        tab = self._tables.get(key)
        if tab is None or tab.shape[0] < length:
            n = max(length, 2 * tab.shape[0] if tab is not None else 1024)
            inv = (
                base ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
                if freqs is None
                else torch.from_numpy(np.asarray(freqs, np.float64))
            )
            ang = (torch.arange(n, dtype=torch.float64) * scale)[:, None] * inv[None, :]
            tab = torch.polar(torch.ones_like(ang), ang).to(torch.complex64).to(device)
            self._tables[key] = tab
        return tab
