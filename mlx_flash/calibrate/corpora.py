"""Real text available offline: six Jane Austen novels (Debian r-cran-janeaustenr, an R data file)
for calibration/training and ~100 English Wikipedia articles (test data inside the gensim wheel) for
validation. Fetched through the package registries' own clients into a cache dir; never committed.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib

from ..config import default_cache_dir
from ..durable import write_durably
from ..errors import FlashError, ModelNotFoundError
from ..store.atomic_dir import OutputError

AUSTEN = "austen.txt"
WIKIPEDIA = "wikipedia.txt"
AUSTEN_PACKAGE = "r-cran-janeaustenr"
GENSIM_VERSION = "4.4.0"
AUSTEN_ORDER = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")


def data_dir(cache_dir: str | None = None) -> str:
    return os.path.join(cache_dir or default_cache_dir(), "data")


def corpus_path(name: str, cache_dir: str | None = None) -> str:
    """Path of a fetched corpus ("austen" or "wikipedia"); raises if tools/fetch_data.py has not run."""
    path = os.path.join(data_dir(cache_dir), {"austen": AUSTEN, "wikipedia": WIKIPEDIA}[name])
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path}: corpus not fetched yet (run: python tools/fetch_data.py)")
    return path


def read_corpus(name: str, cache_dir: str | None = None) -> str:
    """The text of a fetched corpus ("austen" or "wikipedia"); raises as corpus_path does."""
    with open(corpus_path(name, cache_dir), encoding="utf-8") as fh:
        return fh.read()


def _run(cmd: list[str], cwd: str) -> None:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FlashError(f"{' '.join(cmd[:3])} failed (exit {r.returncode}): {tail[0]}")


def fetch_austen(out_dir: str) -> str:
    """apt-get download the Debian package (no install: it would pull all of R), unpack it and
    decode the novels from R's lazy-load database."""
    out = os.path.join(out_dir, AUSTEN)
    with tempfile.TemporaryDirectory() as tmp:
        _run(["apt-get", "download", AUSTEN_PACKAGE], tmp)
        deb = glob.glob(os.path.join(tmp, "*.deb"))[0]
        _run(["dpkg-deb", "-x", deb, "x"], tmp)
        ddir = glob.glob(os.path.join(tmp, "x", "usr", "lib", "R", "site-library", "janeaustenr", "data"))[0]
        books = read_r_lazyload(os.path.join(ddir, "Rdata"))
    write_durably(out, [("\n".join(books[name]).strip() + "\n\n").encode() for name in AUSTEN_ORDER], OutputError)
    return out


def read_r_lazyload(prefix: str) -> dict[str, list[str]]:
    """Decode an R lazy-load DB (prefix.rdx index, prefix.rdb blobs) of character vectors."""
    import warnings

    import rdata

    warnings.filterwarnings("ignore", message="Unknown file type", module="rdata")
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(open(prefix + ".rdx", "rb").read())))
    blob = open(prefix + ".rdb", "rb").read()
    out = {}
    for name, (off, length) in index["variables"].items():
        chunk = blob[int(off) : int(off) + int(length)]
        (size,) = struct.unpack(">I", chunk[:4])  # uncompressed size, then a zlib stream
        data = zlib.decompress(chunk[4:])
        if len(data) != size:
            raise FlashError(f"{prefix}.rdb: entry {name} decompressed to {len(data)} bytes, index says {size}")
        out[str(name)] = [
            str(s) if s is not None else "" for s in rdata.conversion.convert(rdata.parser.parse_data(data))
        ]
    return out


def fetch_wikipedia(out_dir: str) -> str:
    """pip download the gensim wheel (no install) and turn its enwiki test dump into plain text."""
    out = os.path.join(out_dir, WIKIPEDIA)
    with tempfile.TemporaryDirectory() as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"gensim=={GENSIM_VERSION}", "-d", tmp],
            tmp,
        )
        whl = glob.glob(os.path.join(tmp, "gensim-*.whl"))[0]
        with zipfile.ZipFile(whl) as z:
            name = next(n for n in z.namelist() if re.search(r"test_data/enwiki-latest-pages-articles.*\.bz2$", n))
            xml = bz2.decompress(z.read(name)).decode("utf-8")
    articles = wiki_articles(xml)
    write_durably(out, [f"{title}\n\n{text}\n\n".encode() for title, text in articles], OutputError)
    return out


def wiki_articles(xml: str) -> list[tuple[str, str]]:
    """(title, plain text) of every non-redirect main-namespace page of a MediaWiki XML dump."""
    import html

    out = []
    for page in re.findall(r"<page>(.*?)</page>", xml, flags=re.S):
        title = re.search(r"<title>(.*?)</title>", page, flags=re.S)
        ns = re.search(r"<ns>(\d+)</ns>", page)
        text = re.search(r"<text[^>]*>(.*?)</text>", page, flags=re.S)
        if not (title and text) or (ns and ns.group(1) != "0"):
            continue
        body = html.unescape(text.group(1))
        if body.lstrip().upper().startswith("#REDIRECT"):
            continue
        clean = wikitext_to_plain(body)
        if len(clean) > 200:
            out.append((html.unescape(title.group(1)), clean))
    return out


def wikitext_to_plain(t: str) -> str:
    """Good-enough wikitext stripping: templates, tables, refs, files, markup -> prose."""
    t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
    t = re.sub(r"<ref[^>/]*/>", "", t)
    t = re.sub(r"<ref[^>]*>.*?</ref>", "", t, flags=re.S)
    for _ in range(5):  # nested templates and tables, innermost first
        t = re.sub(r"\{\{[^{}]*\}\}", "", t)
        t = re.sub(r"\{\|[^{}]*?\|\}", "", t, flags=re.S)
    t = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", t, flags=re.I)
    t = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", t)
    t = re.sub(r"\[https?://[^\s\]]+ ?([^\]]*)\]", r"\1", t)
    t = re.sub(r"<[^>]+>", "", t)
    t = re.sub(r"'{2,}", "", t)
    t = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", t, flags=re.M)
    t = re.sub(r"^[*#:;]+\s*", "", t, flags=re.M)
    t = re.sub(r"^\s*[|!].*$", "", t, flags=re.M)
    t = re.sub(r"[ \t]+", " ", t)
    t = re.sub(r"\n{3,}", "\n\n", t)
    return t.strip()


def fetch_all(cache_dir: str | None = None, force: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """Fetch every corpus that is missing; returns ({name: path}, {name: error}) so one failure
    (say, no apt-get on macOS) does not stop the others."""
    out_dir = data_dir(cache_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths, errors = {}, {}
    for name, fn, fname in (("austen", fetch_austen, AUSTEN), ("wikipedia", fetch_wikipedia, WIKIPEDIA)):
        path = os.path.join(out_dir, fname)
        try:
            if force or not os.path.isfile(path):
                if name == "austen" and not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
                    raise FlashError("fetching the Austen corpus needs Debian's apt-get and dpkg-deb")
                fn(out_dir)
            paths[name] = path
        except (FlashError, OSError, IndexError, StopIteration) as e:
            errors[name] = str(e) or type(e).__name__
    return paths, errors
