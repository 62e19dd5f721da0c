"""Hub names: `--model org/name` and `org/name:Q4_K_M`, as mlx-lm and llama.cpp's `-hf` take them.

A name resolves to a local path, first found first:
  1. an existing file or folder of that name (a local path always wins);
  2. the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub:
     the folders huggingface_hub and every tool using it fill);
  3. unless HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: a download from HF_ENDPOINT (default
     huggingface.co) into that cache, with a progress bar; the bytes an interrupted transfer left,
     in this run or an earlier one, are kept and the rest asked for (download.py).
A repository holding GGUF files gives the file of the named quant (every part of a split one); with
no quant named, the first of DEFAULT_QUANTS it has (said on stderr), or its only GGUF. Any other
repository is an HF or mlx-community model folder: config.json, weights and tokenizer files.
A missing or ambiguous name is one line saying what was tried and what exists; a cached snapshot's
link whose blob is gone is named as that (the link, the blob, what to do), not as a file never cached.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from ..errors import ConfigError, FlashError, ModelNotFoundError
from .download import HubRefused, download, list_files

NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[A-Za-z0-9_]+))?$")
# llama.cpp's `-hf` default first; then the block types the converter keeps byte for byte.
DEFAULT_QUANTS = ("Q4_K_M", "Q4_0", "Q4_1", "Q8_0")
PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# What an HF / mlx-community folder needs (weights, config, tokenizer, chat template); never the
# other formats some repositories carry as well (pytorch_model.bin, onnx/, ...).
MODEL_FILE = re.compile(r"^[^/]*(\.safetensors|\.json|tokenizer\.model|\.jinja|merges\.txt|vocab\.txt)$")


@dataclass(frozen=True)
class HubName:
    repo: str
    quant: str | None


def parse(name: str) -> HubName | None:
    m = NAME.match(name)
    return HubName(m.group("repo"), m.group("quant")) if m else None


def hub_cache() -> str:
    """The Hugging Face cache, as huggingface_hub finds it (read now: tests and users set it late)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve(name: str, progress: bool = True) -> str:
    """The local path `name` stands for (see the module docstring)."""
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.exists(path):
        return path
    hub = parse(name)
    if hub is None:  # (not org/name[:QUANT]: a path that is not there)
        raise ModelNotFoundError(f"{path}: no such file or directory")
    cached = cached_files(hub.repo)
    if cached:
        try:
            return _resolve_in(name, hub, cached, progress)
        except (ModelNotFoundError, ConfigError):
            if offline():
                raise
    elif offline():
        raise ModelNotFoundError(f"{name}: not in the Hugging Face cache ({hub_cache()}), and HF_HUB_OFFLINE is set")
    return _resolve_in(name, hub, _hub_files(hub, cached), progress)


def _resolve_in(name: str, hub: HubName, files: list[str], progress: bool) -> str:
    """`name` among a repository's `files` (the cached snapshot's or the hub's), fetched if need be."""
    ggufs = [f for f in files if f.endswith(".gguf")]
    if ggufs:
        parts = pick_gguf(name, hub, ggufs, progress)
        return [fetch(hub.repo, f, progress) for f in parts][0]
    if hub.quant:
        raise ConfigError(f"{name}: {hub.repo} holds no GGUF files, and a :{hub.quant} names a GGUF quant")
    needed = [f for f in files if MODEL_FILE.match(f)]
    if "config.json" not in needed or not any(f.endswith(".safetensors") for f in needed):
        raise ModelNotFoundError(f"{name}: neither a GGUF file nor config.json and weights (files: {_few(files)})")
    paths = [fetch(hub.repo, f, progress) for f in needed]
    return os.path.dirname(paths[needed.index("config.json")])


def cached_files(repo: str) -> list[str]:
    """The files of `repo`'s cached snapshot (refs/main, else the newest), relative to it. A link
    whose blob is gone is listed too: the repository has that file, and fetch() names what is
    wrong with it rather than calling the repository absent."""
    snap = _snapshot(repo)
    if snap is None:
        return []
    out = []
    for root, _, names in os.walk(snap, followlinks=False):
        for n in names:
            out.append(os.path.relpath(os.path.join(root, n), snap).replace(os.sep, "/"))
    return sorted(out)


def missing_blob(link: str) -> str | None:
    """The blob a snapshot link points to, when that blob is gone (a cache cleaned by hand, a disk
    that lost it); None for a file that is there or a name that is not a link."""
    if not os.path.islink(link) or os.path.exists(link):
        return None
    return os.path.normpath(os.path.join(os.path.dirname(link), os.readlink(link)))


def _lost_blob(repo: str, filename: str, snap: str, blob: str, why: str, todo: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"{repo}/{filename}: the cached link {os.path.join(snap, filename)} points to the blob {blob}, which is "
        f"missing, and {why}; {todo}, or remove the snapshot {snap}"
    )


def _repo_dir(repo: str) -> str:
    return os.path.join(hub_cache(), "models--" + repo.replace("/", "--"))


def _snapshot(repo: str) -> str | None:
    base = _repo_dir(repo)
    try:
        with open(os.path.join(base, "refs", "main")) as f:
            snap = os.path.join(base, "snapshots", f.read().strip())
        if os.path.isdir(snap):
            return snap
    except OSError:
        pass
    try:
        snaps = [os.path.join(base, "snapshots", s) for s in os.listdir(os.path.join(base, "snapshots"))]
    except OSError:
        return None
    return max(snaps, key=os.path.getmtime) if snaps else None


def _hub_files(hub: HubName, cached: list[str]) -> list[str]:
    """The repository's files as the hub lists them; the cache's when it cannot be reached."""
    try:
        return list_files(hub.repo, _endpoint())
    except HubRefused as e:
        if cached:
            return cached
        why = "is gated (log in with `hf auth login`)" if e.gated else "was not found"
        raise ModelNotFoundError(
            f"{hub.repo}: not in the Hugging Face cache ({hub_cache()}), and the hub {why}"
        ) from None
    except Exception as e:  # no network, DNS, TLS, a proxy: the cache is what there is
        if cached:
            return cached
        raise ModelNotFoundError(
            f"{hub.repo}: not in the Hugging Face cache ({hub_cache()}), and the hub cannot be reached ({_why(e)})"
        ) from None


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _quant_of(filename: str) -> str:
    """The quant a GGUF file's name carries: the last name part before .gguf (and before -0000N-of-...)."""
    stem = PART.sub(".gguf", os.path.basename(filename))[: -len(".gguf")]
    return re.split(r"[-.]", stem)[-1]


def pick_gguf(name: str, hub: HubName, ggufs: list[str], progress: bool) -> list[str]:
    """The GGUF file (all parts of a split one) `name` means, in part order."""
    by_quant: dict[str, list[str]] = {}
    for f in ggufs:
        by_quant.setdefault(_quant_of(f).upper(), []).append(f)
    have = ", ".join(sorted(by_quant))
    if hub.quant:
        quant = hub.quant.upper()
        if quant not in by_quant:
            raise ModelNotFoundError(f"{name}: the repository has no {hub.quant} GGUF (its quants: {have})")
    else:
        quant = next((q for q in DEFAULT_QUANTS if q in by_quant), None)
        if quant is None and len(by_quant) == 1:
            quant = next(iter(by_quant))
        if quant is None:
            raise ConfigError(f"{name}: {hub.repo} has several GGUF quants ({have}); name one, as {hub.repo}:QUANT")
        if progress:
            print(
                f"{hub.repo}: {quant} (the first of {', '.join(DEFAULT_QUANTS)} it has; quants there: {have})",
                file=sys.stderr,
            )
    files = by_quant[quant]
    bases = {PART.sub("", f) for f in files}
    if len(bases) > 1:
        raise ConfigError(
            f"{name}: {len(bases)} {quant} GGUF files in {hub.repo} ({_few(sorted(files))}); "
            "give the file's path instead"
        )
    return sorted(files, key=lambda f: int(PART.search(f).group(1)) if PART.search(f) else 0)


def fetch(repo: str, filename: str, progress: bool) -> str:
    """The cached path of one file, downloaded (with a progress bar, resuming a partial one) if needed."""
    snap = _snapshot(repo)
    if snap is not None and os.path.exists(os.path.join(snap, filename)):
        return os.path.join(snap, filename)
    lost = missing_blob(os.path.join(snap, filename)) if snap is not None else None
    if offline():
        if lost:
            raise _lost_blob(repo, filename, snap, lost, "HF_HUB_OFFLINE is set", "unset it to download the file again")
        raise ModelNotFoundError(
            f"{repo}/{filename}: not in the Hugging Face cache ({hub_cache()}), and HF_HUB_OFFLINE is set"
        )
    if progress:
        print(f"downloading {repo}/{filename} into {hub_cache()}", file=sys.stderr)
    try:
        return download(repo, filename, _repo_dir(repo), _endpoint(), progress)
    except FlashError:
        raise
    except Exception as e:  # network errors of every kind: one line, the partial file kept for a resume
        if lost:
            raise _lost_blob(
                repo, filename, snap, lost, f"downloading it again failed ({_why(e)})", "run again when the hub answers"
            ) from None
        raise ModelNotFoundError(
            f"{repo}/{filename}: the download failed ({_why(e)}); run again to resume it"
        ) from None


def _why(e: Exception) -> str:
    first = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _few(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "") if items else "none"
