"""Starting the ranks of a group on this machine the way its launcher does (distributed.local), as
separate processes the test can watch, stop and kill one by one (mlx.launch ends the others when
one exits)."""

from __future__ import annotations

import os
import subprocess
import sys

from mlx_flash.distributed.local import rank_envs


def start_ranks(
    n: int, argv, tmp, env: dict | None = None, launcher: str = "ring", stdin: bool = False
) -> list[subprocess.Popen]:
    """n processes of `python argv...` (argv: a list, or rank -> list), ranks 0..n-1 of one group over
    loopback; stdin: each reads a pipe (communicate() writes rank 0's lines)."""
    procs = []
    for r, group in enumerate(rank_envs(n, str(tmp), launcher)):
        e = {**os.environ, **(env or {}), **group}
        procs.append(
            subprocess.Popen(
                [sys.executable, *(argv(r) if callable(argv) else argv)],
                env=e,
                stdin=subprocess.PIPE if stdin else None,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs
