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
import queue
import sys
import threading
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
            raise FlashError(
                "no MLX distributed group: start every rank with `mlx.launch --backend ring "
                f"--hosts ...` (or `-n N` on one machine): {e}"
            ) from None
        self.rank, self.size = self.group.rank(), self.group.size()
        self.stream = mx.cpu  # the ring backend runs on the CPU
        self._local = threading.local()

    def _thread_stream(self):
        """A CPU stream of this thread's own. Sends (from an Outbox thread) and receives must not share
        one: ops on a stream run in order, so a send queued behind a receive that waits for the peer
        would wait with it, and the peer likewise. (MLX streams belong to the thread that made them.)"""
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = self.mx.new_stream(self.mx.cpu)
        return s

    def send(self, array: np.ndarray, dst: int) -> None:
        try:
            self.mx.eval(
                self.mx.distributed.send(self.mx.array(array), dst, group=self.group, stream=self._thread_stream())
            )
        except RuntimeError as e:
            raise PeerLostError(dst, f"sending to it failed ({e})") from None

    def recv(self, shape: tuple, dtype, src: int) -> np.ndarray:
        like = self.mx.zeros(tuple(shape), dtype=self.mx.float32 if np.dtype(dtype) == np.float32 else self.mx.int32)
        try:
            out = self.mx.distributed.recv_like(like, src, group=self.group, stream=self._thread_stream())
            self.mx.eval(out)
        except RuntimeError as e:
            raise PeerLostError(src, f"receiving from it failed ({e})") from None
        return np.array(out, copy=True)

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        v = np.asarray(values, dtype=np.int64)
        if np.any(np.abs(v) >= 2**31):
            raise ValueError("all_gather carries int32 values (send sizes in MiB)")
        try:
            out = self.mx.distributed.all_gather(
                self.mx.array(v.astype(np.int32).reshape(1, -1)), group=self.group, stream=self.stream
            )
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


class Outbox:
    """A rank's sends, in order, on a thread of their own, so that the rank goes on receiving while a
    send waits for its receiver. With several messages in flight round a ring, every rank can be
    sending at once; gloo's send waits for the matching receive, so blocking sends would deadlock.
    A send that fails is raised by the next put() or flush()."""

    def __init__(self, transport: Transport):
        self.t = transport
        self._q: queue.Queue = queue.Queue()
        self.error: PeerLostError | None = None
        self._thread = threading.Thread(target=self._run, name="mlx-flash-outbox", daemon=True)
        self._thread.start()

    def put(self, arrays: list, dst: int) -> None:
        """Send `arrays` to `dst` after everything put before them."""
        if self.error is not None:
            raise self.error
        self._q.put((arrays, dst))

    def flush(self) -> None:
        """Wait until everything put has been sent (raises the first failure)."""
        self._q.join()
        if self.error is not None:
            raise self.error

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread after what was put (not waiting past `timeout` on a send to a peer that
        stopped answering: the thread is a daemon)."""
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    arrays, dst = item
                    try:
                        for a in arrays:
                            self.t.send(a, dst)
                    except PeerLostError as e:
                        self.error = e
                    except Exception as e:  # noqa: BLE001 - a send that failed otherwise must not vanish
                        self.error = PeerLostError(dst, f"sending to it failed ({type(e).__name__}: {e})")
            finally:
                self._q.task_done()


def launcher_rank() -> int:
    """This process's rank as its launcher set it (0 outside a launcher), before the group is joined."""
    for var in ("MLX_RANK", "RANK"):
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return 0


def open_transport() -> Transport:
    """The transport of the launcher that started this process: mlx.launch (MLX_RANK) or torchrun
    (TORCHELASTIC_RUN_ID / RANK and WORLD_SIZE)."""
    if "MLX_RANK" in os.environ:
        return MLXRing()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return TorchGloo()
    stem = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    command = f"mlx_flash.{stem}" if stem in ("chat", "serve", "batch") else "mlx_flash.chat"  # (the one running)
    raise FlashError(
        "--pipeline runs under a launcher that starts every rank: `mlx.launch --backend ring "
        f"--hosts h1,h2 -- python -m {command} --pipeline ...` or `torchrun --nnodes 2 ... -m "
        f"{command} --pipeline ...`"
    )
