"""How pipeline stages exchange arrays: numpy in, numpy out, over the framework's own distributed
engine (no home-made transport). A `Transport` is the one protocol the pipeline calls:

  rank, size                   this process's place in the group
  send(array, dst)             a float32 / int32 numpy array to a neighbouring rank
  recv(shape, dtype, src)      the array of that shape and type a neighbour sends
  all_gather(values)           int [k] from every rank -> [size, k], in rank order (int32 range)
  close()                      leave the group

A peer that dies mid-call raises `PeerLostError` naming the peer this rank was talking to.
`MLXRing` is MLX's ring backend (`mlx.launch --backend ring`): sends go to ring neighbours only, which
is all a pipeline needs (rank r to r + 1, the last rank back to rank 0). `TorchGloo` is
torch.distributed's gloo backend (`torchrun`). `open_transport` takes the one whose launcher started
this process; either carries either compute backend's hidden states (numpy on the wire's edge).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import numpy as np

from ..errors import FlashError


class PeerLostError(FlashError):
    """A rank stopped answering: its process died or its connection broke."""

    def __init__(self, peer: int, why: str):
        super().__init__(f"rank {peer}: {why}")
        self.peer = peer


class Transport(ABC):
    rank: int
    size: int

    @abstractmethod
    def send(self, array: np.ndarray, dst: int) -> None: ...

    @abstractmethod
    def recv(self, shape: tuple, dtype, src: int) -> np.ndarray: ...

    @abstractmethod
    def all_gather(self, values: np.ndarray) -> np.ndarray: ...

    def close(self) -> None:
        """Leave the group (after the last message)."""


class MLXRing(Transport):
    """mx.distributed over the ring backend, started by mlx.launch (or by its environment variables)."""

    def __init__(self):
        import mlx.core as mx

        self.mx = mx
        try:
            self.group = mx.distributed.init(strict=True, backend="ring")
        except (RuntimeError, ValueError) as e:
            raise FlashError("no MLX distributed group: start every rank with `mlx.launch --backend ring "
                             f"--hosts ...` (or `-n N` on one machine): {e}") from None
        self.rank, self.size = self.group.rank(), self.group.size()
        self.stream = mx.cpu  # the ring backend runs on the CPU stream

    def send(self, array: np.ndarray, dst: int) -> None:
        try:
            self.mx.eval(self.mx.distributed.send(self.mx.array(array), dst, group=self.group, stream=self.stream))
        except RuntimeError as e:
            raise PeerLostError(dst, f"sending to it failed ({e})") from None

    def recv(self, shape: tuple, dtype, src: int) -> np.ndarray:
        like = self.mx.zeros(tuple(shape), dtype=self.mx.float32 if np.dtype(dtype) == np.float32 else self.mx.int32)
        try:
            out = self.mx.distributed.recv_like(like, src, group=self.group, stream=self.stream)
            self.mx.eval(out)
        except RuntimeError as e:
            raise PeerLostError(src, f"receiving from it failed ({e})") from None
        return np.array(out, copy=True)

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        v = np.asarray(values, dtype=np.int64)
        if np.any(np.abs(v) >= 2 ** 31):
            raise ValueError("all_gather carries int32 values (send sizes in MiB)")
        try:
            out = self.mx.distributed.all_gather(self.mx.array(v.astype(np.int32).reshape(1, -1)), group=self.group,
                                                 stream=self.stream)
            self.mx.eval(out)
        except RuntimeError as e:
            raise FlashError(f"a rank left the group while the ranks exchanged their plans ({e})") from None
        return np.array(out).astype(np.int64).reshape(self.size, -1)


class TorchGloo(Transport):
    """torch.distributed over gloo, started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""

    def __init__(self, timeout: float = 60.0):
        import datetime

        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        if not dist.is_initialized():
            try:  # a collective whose peer is gone fails after `timeout`, not gloo's default 30 minutes
                dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
            except (RuntimeError, ValueError) as e:
                raise FlashError(f"no torch.distributed group: start every rank with torchrun: {e}") from None
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def send(self, array: np.ndarray, dst: int) -> None:
        try:
            self.dist.send(self.torch.from_numpy(np.ascontiguousarray(array)), dst)
        except RuntimeError as e:
            raise PeerLostError(dst, f"sending to it failed ({e})") from None

    def recv(self, shape: tuple, dtype, src: int) -> np.ndarray:
        out = np.empty(tuple(shape), dtype=np.float32 if np.dtype(dtype) == np.float32 else np.int32)
        try:
            self.dist.recv(self.torch.from_numpy(out), src)
        except RuntimeError as e:
            raise PeerLostError(src, f"receiving from it failed ({e})") from None
        return out

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        v = self.torch.from_numpy(np.asarray(values, dtype=np.int64).reshape(-1).copy())
        parts = [self.torch.zeros_like(v) for _ in range(self.size)]
        try:
            self.dist.all_gather(parts, v)
        except RuntimeError as e:
            raise FlashError(f"a rank left the group while the ranks exchanged their plans ({e})") from None
        return np.stack([p.numpy() for p in parts])

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def open_transport() -> Transport:
    """The transport of the launcher that started this process: mlx.launch (MLX_RANK) or torchrun
    (TORCHELASTIC_RUN_ID / RANK and WORLD_SIZE)."""
    if "MLX_RANK" in os.environ:
        return MLXRing()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return TorchGloo()
    raise FlashError("--pipeline runs under a launcher that starts every rank: `mlx.launch --backend ring "
                     "--hosts h1,h2 -- python -m mlx_flash.chat --pipeline ...` or `torchrun --nnodes 2 ... -m "
                     "mlx_flash.chat --pipeline ...`")
