"""A server subprocess for the tests (`python -m mlx_flash.serve` on the default model's store): start
it on a free loopback port, talk to it, stop it."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from mlx_flash.bench.load_client import stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = "127.0.0.1"  # loopback only
CHAT = "/v1/chat/completions"


class Srv:
    def __init__(self, proc, port, directory, log):
        self.proc, self.port, self.directory, self.log = proc, port, directory, log
        self.base = f"http://{HOST}:{port}"
        self.model = None

    def log_text(self) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def request(self, method, path, body=None, headers=None, key=None, timeout=120):
        """-> (status, headers, parsed JSON or raw text). body: dict/list (JSON) or bytes (as is)."""
        h = dict(headers or {})
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        if body is not None:
            h.setdefault("Content-Type", "application/json")
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            raw = r.read().decode()
            try:
                data = json.loads(raw)
            except json.JSONDecodeError:
                data = raw
            return r.status, r.headers, data
        finally:
            conn.close()

    def stats(self, key=None) -> dict:
        status, _, data = self.request("GET", "/v1/stats", key=key)
        assert status == 200, data
        return data

    def healthy(self) -> bool:
        try:
            return self.request("GET", "/health", timeout=5)[0] == 200
        except OSError:
            return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start(store_dir, directory, *extra, key=None, kv_budget="30MB", cgroup=None) -> Srv:
    """The server on store_dir, its service directory and log under `directory`, up and answering;
    cgroup: a bench.cgroup.MemoryCgroup it runs inside."""
    os.makedirs(directory, exist_ok=True)
    for attempt in range(3):  # the free port may be taken between the probe and the bind
        port = free_port()
        log = os.path.join(directory, f"server-{port}.log")
        cmd = [
            sys.executable,
            "-m",
            "mlx_flash.serve",
            "--model",
            store_dir,
            "--host",
            HOST,
            "--port",
            str(port),
            "--kv-budget",
            kv_budget,
            "--service-dir",
            os.path.join(directory, "svc"),
            *extra,
        ]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cgroup.joined(cmd) if cgroup is not None else cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
            )
        srv = Srv(proc, port, directory, log)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and not srv.healthy():
            time.sleep(0.2)
        if srv.healthy():
            status, _, models = srv.request("GET", "/v1/models", key=key)
            assert status == 200, models
            srv.model = models["data"][0]["id"]
            return srv
        stop(srv)
        if "cannot serve" not in srv.log_text() or attempt == 2:
            pytest.fail(f"the server did not come up:\n{srv.log_text()}")
    raise AssertionError("unreachable")


def stop(srv: Srv) -> int:
    return stop_process(srv.proc)


def chat_body(messages, **kw):
    return {"messages": messages, "temperature": 0, "max_tokens": kw.pop("max_tokens", 20), **kw}


def vm_hwm(pid: int) -> int:
    """A process's peak resident bytes (VmHWM)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")
