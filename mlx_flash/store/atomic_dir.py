"""Write a directory all at once: into a hidden sibling that replaces `out_dir` only when the
writing finished, so a crash or Ctrl-C never leaves a half-written directory under the real name."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager


@contextmanager
def atomic_dir(out_dir: str):
    """with atomic_dir(out) as tmp: write into tmp; on success tmp becomes out (replacing it)."""
    out_dir = os.path.abspath(out_dir)
    tmp = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
