"""Starting the ranks of a group on this machine the way its launcher does, as separate processes the
test can watch, stop and kill one by one (mlx.launch ends the others when one exits): an MLX ring (a
host file of 127.0.0.1 ports and MLX_RANK per process, as mlx.launch) or torch.distributed gloo
(RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_ranks(n: int, argv, tmp, env: dict | None = None, launcher: str = "ring") -> list[subprocess.Popen]:
    """n processes of `python argv...` (argv: a list, or rank -> list), ranks 0..n-1 of one group over
    loopback."""
    if launcher == "ring":
        hostfile = os.path.join(str(tmp), "hosts.json")
        with open(hostfile, "w") as fh:
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], fh)
        group = lambda r: {"MLX_RANK": str(r), "MLX_HOSTFILE": hostfile}  # noqa: E731
    else:
        port = free_ports(1)[0]
        group = lambda r: {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),  # noqa: E731
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = []
    for r in range(n):
        e = {**os.environ, **(env or {}), **group(r)}
        procs.append(subprocess.Popen([sys.executable, *(argv(r) if callable(argv) else argv)], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs
