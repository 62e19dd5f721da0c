"""Starting the ranks of an MLX ring on this machine the way mlx.launch does (a host file of
127.0.0.1 ports and MLX_RANK per process), but as separate processes the test can watch, stop and
kill one by one (mlx.launch ends the others when one exits)."""

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


def start_ranks(n: int, argv: list[str], tmp, env: dict | None = None) -> list[subprocess.Popen]:
    """n processes of `python argv...`, ranks 0..n-1 of one ring over loopback."""
    hostfile = os.path.join(str(tmp), "hosts.json")
    with open(hostfile, "w") as fh:
        json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], fh)
    procs = []
    for r in range(n):
        e = {**os.environ, **(env or {}), "MLX_RANK": str(r), "MLX_HOSTFILE": hostfile}
        procs.append(subprocess.Popen([sys.executable, *argv], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs
