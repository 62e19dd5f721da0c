"""One file of a hub repository into the Hugging Face cache, resuming what an earlier run left.

huggingface_hub resumes a transfer that breaks within one call, but writes each call into a fresh
temporary file, so a download stopped by Ctrl-C or a dropped network starts again from byte 0: for
a multi-gigabyte GGUF that is the difference between minutes and an hour. Here the bytes go to
`blobs/<etag>.incomplete`, appended from where it ends (a Range request), under a lock so two
processes never append to one file, and fsynced as each transfer ends (durable.AppendFile), so what
arrived survives a crash and the next run resumes from it; the finished blob gets the snapshot link
and refs/main the cache layout has, so huggingface_hub and every tool using the cache find it too. The metadata
request (auth, the hub's redirects, its error codes) is huggingface_hub's.

The file list is asked for here too: huggingface_hub's listing retries a refused connection five
times with backoff (23 s), so a user without network whose model is cached waited that long before
the cache answered. A refused or unresolvable host fails at once; a slow one after LIST_TIMEOUT_S.
"""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

from ..durable import AppendFile, disk_error, move_durably, sync_folder, write_durably
from ..errors import ModelNotFoundError
from ..store.atomic_dir import OutputError

PIECE = 1 << 20
RETRIES = 5  # transfers per call (huggingface_hub's own count)
LIST_TIMEOUT_S = 15
DEFAULT_ENDPOINT = "https://huggingface.co"


class HubRefused(Exception):
    """The hub answered, and not with the list: the repository is missing, or gated."""

    def __init__(self, gated: bool):
        super().__init__("gated" if gated else "not found")
        self.gated = gated


def list_files(repo: str, endpoint: str | None) -> list[str]:
    """Every file path of `repo`'s main revision, following the hub's pages."""
    from huggingface_hub.utils import build_hf_headers

    url: str | None = f"{endpoint or DEFAULT_ENDPOINT}/api/models/{repo}/tree/main?recursive=true"
    files: list[str] = []
    while url:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=build_hf_headers()), timeout=LIST_TIMEOUT_S
            ) as r:
                files += [e["path"] for e in json.load(r) if e.get("type") == "file"]
                url = _next_page(r.headers.get("Link", ""))
        except urllib.error.HTTPError as e:
            if e.code in (401, 403, 404):  # (the hub says 401 for a missing repository to a stranger)
                raise HubRefused(gated=e.headers.get("X-Error-Code") == "GatedRepo") from None
            raise
    return sorted(files)


def _next_page(link: str) -> str | None:
    for part in link.split(","):
        if 'rel="next"' in part and "<" in part:
            return part[part.index("<") + 1 : part.index(">")]
    return None


def download(repo: str, filename: str, repo_dir: str, endpoint: str | None, progress: bool) -> str:
    """Fetch `filename` of `repo` into the cache folder `repo_dir`; its snapshot path."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers
    from tqdm import tqdm

    url = hf_hub_url(repo, filename, endpoint=endpoint)
    meta = get_hf_file_metadata(url, endpoint=endpoint)
    if not meta.etag or not meta.commit_hash:
        raise ModelNotFoundError(f"{url}: the hub's answer names no file version (etag, commit)")
    blob = os.path.join(repo_dir, "blobs", meta.etag)
    link = os.path.join(repo_dir, "snapshots", meta.commit_hash, filename)
    try:
        os.makedirs(os.path.dirname(blob), exist_ok=True)
    except OSError as e:
        raise disk_error(OutputError, blob, e) from None
    part = blob + ".incomplete"
    with open(part + ".lock", "w") as lock:  # (not durable: a lock holds no data)
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # another process fetching it: wait, then find it done
        if not os.path.exists(blob):
            auth = build_hf_headers() if _same_host(meta.location, url) else {}  # never a token to a CDN
            with tqdm(total=meta.size, unit="B", unit_scale=True, desc=filename, disable=not progress) as bar:
                for attempt in range(RETRIES):
                    try:
                        _transfer(meta.location, auth, part, meta.size, bar)
                        break
                    except urllib.error.HTTPError:
                        raise  # the hub's answer, not a dropped connection
                    except (OSError, http.client.HTTPException):  # dropped: go on from what arrived
                        if attempt == RETRIES - 1:
                            raise
                        time.sleep(0.5 * (attempt + 1))
            got = os.path.getsize(part)
            if meta.size is not None and got != meta.size:
                raise ModelNotFoundError(f"{repo}/{filename}: {got} of {meta.size} bytes arrived; run again to resume")
            move_durably(part, blob, OutputError)  # (its bytes were fsynced as each transfer ended)
    try:
        if not os.path.lexists(link):
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
            sync_folder(os.path.dirname(link))
        os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
    except OSError as e:
        raise disk_error(OutputError, e.filename or link, e) from None
    write_durably(os.path.join(repo_dir, "refs", "main"), [meta.commit_hash.encode()], OutputError)
    return link


def _transfer(location: str, auth: dict, part: str, size: int | None, bar) -> None:
    """Append the bytes `part` lacks (all of them when the server ignores the Range asked for)."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    if size is not None and have >= size:
        have = have if have == size else 0  # (more than the file: not this version's bytes)
        if have:
            return
    headers = dict(auth, Range=f"bytes={have}-") if have else dict(auth)
    with urllib.request.urlopen(urllib.request.Request(location, headers=headers), timeout=60) as r:
        if r.status != 206:
            have = 0
        bar.reset(total=size)
        bar.update(have)
        with AppendFile(part, OutputError, fresh=not have, needed=size) as f:
            while piece := r.read(PIECE):
                f.write(piece)
                bar.update(len(piece))
    if size is not None and os.path.getsize(part) < size:  # (a dropped connection can read as an end)
        raise ConnectionError(f"the transfer ended after {os.path.getsize(part)} of {size} bytes")


def _same_host(a: str, b: str) -> bool:
    return urllib.parse.urlsplit(a).netloc == urllib.parse.urlsplit(b).netloc
