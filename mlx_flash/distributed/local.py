"""The environment a launcher gives each rank of a group on this machine (loopback): what
mlx.launch sets for MLX's ring (a host file of 127.0.0.1 ports, MLX_RANK) or torchrun for gloo
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). For benchmarks and tests that start the ranks
themselves, each in its own memory cgroup or watched one by one."""

from __future__ import annotations

import json
import os
import socket
import sys


def free_ports(n: int) -> list[int]:
    """n TCP ports free on 127.0.0.1 now."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def rank_envs(n: int, folder: str, launcher: str = "ring") -> list[dict]:
    """Environment variables for ranks 0..n-1 (`folder` holds the ring's host file)."""
    if launcher == "ring":
        hostfile = os.path.join(folder, "hosts.json")
        with open(hostfile, "w") as fh:  # (not durable: read by this launch's ranks as they start)
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], fh)
        return [{"MLX_RANK": str(r), "MLX_HOSTFILE": hostfile} for r in range(n)]
    if launcher == "gloo":
        port = free_ports(1)[0]
        # (gloo picks its network interface from the host name, which need not resolve: loopback, named)
        return [
            {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo0" if sys.platform == "darwin" else "lo",
            }
            for r in range(n)
        ]
    raise ValueError(f"launcher {launcher!r} is not ring or gloo")
