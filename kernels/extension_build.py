"""Builds a torch extension from sources shipped in this package, at first use (torch_ops.py,
cuda_sparse.py, cuda_ops.py): copies of the sources in a folder named by a hash of their text and of
what else the build depends on (torch version, GPU architecture), so a changed source or torch gets
a new build and an unchanged one is loaded from there; one process builds while others wait on a
lock, with a line saying so. Nothing falls back silently: a failed build raises
KernelUnavailableError with the compiler's first line. torch is imported only inside functions.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from importlib import resources

from mlx_flash.errors import KernelUnavailableError


def shipped(folder: str, name: str) -> str:
    """A source file shipped in this package (kernels/<folder>/<name>)."""
    return resources.files("mlx_flash.kernels").joinpath(folder, name).read_text()


def folder(root: str, files, salt: str) -> tuple[str, dict[str, str]]:
    """(root/<hash>, the shipped sources' texts by name): the folder a build of `files` ((folder,
    name) pairs) with `salt` (what else it depends on) lives in. Reads the sources, imports nothing."""
    texts = {name: shipped(sub, name) for sub, name in files}
    key = hashlib.sha256("".join(texts.values()).encode() + salt.encode()).hexdigest()
    return os.path.join(root, key[:16]), texts


def is_built(where: str) -> bool:
    return os.path.isdir(where) and any(f.endswith(".so") for f in os.listdir(where))


def build(
    what: str,
    prefix: str,
    root: str,
    files,
    sources,
    salt: str,
    cuda_flags=(),
    cflags=("-O3",),
    python_module: bool = True,
    note: str | None = None,
    load: bool = True,
):
    """Build (or load the build of) the extension `prefix` from `files`, (folder, name) pairs of
    shipped sources copied side by side into root/<hash>, compiling those named in `sources` with the
    C++ flags `cflags` (a caller that changes them names them in `salt`); `what` names it in messages,
    `note` (e.g. how long it takes) is printed when it is built rather than loaded. Returns the module
    (python_module), else the library's path once loaded (operators it registers with TORCH_LIBRARY
    are then in torch.ops). load=False: build when not built yet, and return None without importing
    torch when it is (a build started ahead of its use)."""
    where, texts = folder(root, files, salt)
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not is_built(where):  # else the holder only loads what is built: a wait of seconds, no news
                print(f"waiting for the build of {what} under way in {where}", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        built = is_built(where)
        if built and not load:
            return None
        from torch.utils import cpp_extension  # (imports torch: seconds, so only under the lock, when needed)

        for name, text in texts.items():  # the build reads files: copies of the shipped sources
            path = os.path.join(where, name)
            if not os.path.isfile(path) or _text_of(path) != text:
                with open(path, "w") as fh:  # (a build folder, remade when lost: not durable on purpose)
                    fh.write(text)
        if not built and note:
            print(f"building {what} ({note})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            module = cpp_extension.load(
                name=f"{prefix}_{os.path.basename(where)[:8]}",
                sources=[os.path.join(where, n) for n in sources],
                extra_cflags=list(cflags),
                extra_cuda_cflags=["-O3", *cuda_flags],
                build_directory=where,
                is_python_module=python_module,
                verbose=False,
            )
        except Exception as e:  # a compiler's many lines: the first one names it
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise KernelUnavailableError(f"building {what} in {where} failed: {first}") from None
        if not built and note:
            print(f"built {what} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return module


def cuda_torch(what: str, elsewhere: str):
    """torch where it sees a CUDA device, else KernelUnavailableError naming `what` needs one and
    `elsewhere`, what runs instead."""
    try:
        import torch
    except ImportError:
        raise KernelUnavailableError(
            f"{what}: torch is not installed (pip install 'mlx-flash-engine[torch]')"
        ) from None
    if not torch.cuda.is_available():
        raise KernelUnavailableError(f"{what}: no NVIDIA GPU (torch.cuda.is_available() is false); {elsewhere}")
    return torch


def cuda_arch_flag(torch) -> tuple[str, str]:
    """(the nvcc flag that compiles for the present GPU's architecture, its name sm_XY): the build
    holds code for that architecture only, and its folder's hash names it."""
    major, minor = torch.cuda.get_device_capability()
    return f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}", f"sm_{major}{minor}"


def _text_of(path: str) -> str:
    with open(path) as fh:
        return fh.read()
