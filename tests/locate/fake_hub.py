"""A loopback Hugging Face hub for the download tests (HF_ENDPOINT points at it): the file listing
(/api/models/ORG/NAME/tree/main), HEAD and GET of /ORG/NAME/resolve/main/FILE with the headers
huggingface_hub reads (X-Repo-Commit, ETag, Content-Length), Range requests, and a transfer that
breaks after `cut_after` bytes once, as a dropped connection does. The listing comes in pages of
`page` entries linked by a Link header, as the hub pages it; a repository in `gated` answers 403
with the hub's GatedRepo code. Every request is recorded."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(
        self, repos: dict[str, dict[str, bytes]], cut_after: int = 0, page: int = 1000, gated: tuple[str, ...] = ()
    ):
        self.repos, self.cut_after, self.page, self.gated = repos, cut_after, page, gated
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path, _, query = h.path.partition("?")
        self.requests.append((h.command, path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and parts[4:6] == ["tree", "main"]:
            return self._listing(h, "/".join(parts[2:4]), path, query)
        if len(parts) >= 5 and parts[2:4] == ["resolve", "main"]:
            return self._file(h, "/".join(parts[:2]), "/".join(parts[4:]), body)
        self._missing(h, "Entry")

    def _missing(self, h, what: str) -> None:
        h.send_response(404)
        h.send_header("X-Error-Code", f"{what}NotFound")
        h.send_header("Content-Length", "0")
        h.end_headers()

    def _listing(self, h, repo: str, path: str, query: str) -> None:
        if repo in self.gated:
            h.send_response(403)
            h.send_header("X-Error-Code", "GatedRepo")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        if repo not in self.repos:
            return self._missing(h, "Repo")
        out = [
            {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
            for f, b in self.repos[repo].items()
        ]
        start = int(dict(q.split("=", 1) for q in query.split("&") if "=" in q).get("cursor", 0))
        data = json.dumps(out[start : start + self.page]).encode()
        h.send_response(200)
        if start + self.page < len(out):
            h.send_header("Link", f'<{self.url}{path}?recursive=true&cursor={start + self.page}>; rel="next"')
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _file(self, h, repo: str, name: str, body: bool) -> None:
        data = self.repos.get(repo, {}).get(name)
        if data is None:
            return self._missing(h, "Repo" if repo not in self.repos else "Entry")
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[len("bytes=") :].split("-")[0])
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if not body:
            return
        if self.cut_after and not start:  # the first transfer breaks off: the connection drops
            h.wfile.write(data[: self.cut_after])
            h.wfile.flush()
            self.cut_after = 0
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(data[start:])
