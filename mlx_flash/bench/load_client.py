"""The client side of a load test on the OpenAI-compatible server (service/server.py): start
`python -m mlx_flash.serve` as a subprocess on a free loopback port with a fresh service directory,
stream chat completions from it, many at once, and read its /v1/stats (`python -m mlx_flash.bench concurrency`
drives it).

  Server(directory, flags, start_timeout)       the server subprocess, a context manager; .port, .stats(), .cpu_s()
  stream_chat(port, text, max_tokens)           one streamed, greedy chat completion, timed
  concurrent(port, texts, max_tokens)           all texts streamed at once, released by a barrier
  warm(port, clients)                           requests of other prompts, so that first passes go untimed

Only the standard library's http.client talks to the server (the openai package is not needed).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

HOST = "127.0.0.1"
WARMUP = "Say something friendly about the number {}."


def free_port() -> int:
    """A loopback port free now (another process may take it before the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def request(port: int, method: str, path: str, body=None, timeout: float = 600):
    """(HTTP status, decoded JSON body) of one request; `body` is sent as JSON when given."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


class Server:
    """`python -m mlx_flash.serve` on a free loopback port with a fresh service directory under
    `directory` (its output goes to directory/server.log); `flags` are more of the server's flags.
    Up (answering /health) when constructed, else RuntimeError with the log's end."""

    def __init__(self, directory: str, flags: list, start_timeout: float):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        for _ in range(3):  # the free port may be taken between the probe and the bind
            self.port = free_port()
            self.log = os.path.join(directory, "server.log")
            with open(self.log, "w") as out:  # (not durable: a log for a person)
                self.proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "mlx_flash.serve",
                        "--host",
                        HOST,
                        "--port",
                        str(self.port),
                        "--service-dir",
                        os.path.join(directory, "svc"),
                        *flags,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + start_timeout
            while time.monotonic() < deadline and self.proc.poll() is None and not self.healthy():
                time.sleep(0.2)
            if self.healthy():
                return
            self.stop()
            if "cannot serve" not in self.log_text():
                break
        raise RuntimeError(f"the server did not come up:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def healthy(self) -> bool:
        try:
            return request(self.port, "GET", "/health", timeout=5)[0] == 200
        except OSError:
            return False

    def cpu_s(self):
        """The server process's CPU seconds so far (user + system, Linux), None elsewhere."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def stats(self) -> dict:
        status, data = request(self.port, "GET", "/v1/stats")
        if status != 200:
            raise RuntimeError(f"/v1/stats answered {status}: {data}")
        return data

    def stop(self) -> int:
        return stop_process(self.proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def stream_chat(port: int, text: str, max_tokens: int, barrier=None, timeout: float = 600) -> dict:
    """One streamed chat completion: its chunks' texts, the usage, time to first token and end (s,
    perf_counter; `start` is when the request went out). A failure is kept in "error", not raised,
    so that one client's failure leaves the others' figures."""
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": text}],
            "stream": True,
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    out = {"prompt": text, "deltas": [], "usage": None, "finish_reason": None, "error": None}
    try:
        conn.connect()
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    if barrier is not None:
        barrier.wait()  # every client, connected or not, so that none waits for ever
    out["start"] = time.perf_counter()
    try:
        if out["error"] is not None:
            raise ConnectionError(out["error"])
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read().decode(errors='replace')[:300]}"
        while out["error"] is None:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                break
            obj = json.loads(payload)
            if "error" in obj:
                out["error"] = obj["error"].get("message")
                continue
            if obj.get("usage"):
                out["usage"] = obj["usage"]
            for ch in obj.get("choices") or []:
                content = ch.get("delta", {}).get("content")
                if content is not None:
                    if "first" not in out:
                        out["first"] = time.perf_counter()
                    out["deltas"].append(content)
                out["finish_reason"] = ch.get("finish_reason") or out["finish_reason"]
        out["end"] = time.perf_counter()
    except (OSError, ValueError) as e:  # a refused or dropped connection, a malformed event
        out["error"] = out["error"] or f"{type(e).__name__}: {e}"
        out["end"] = time.perf_counter()
    finally:
        conn.close()
    out["text"] = "".join(out["deltas"])
    out["tokens"] = (out["usage"] or {}).get("completion_tokens", 0)
    out["ttft_s"] = out["first"] - out["start"] if "first" in out else None
    return out


def concurrent(port: int, texts: list, max_tokens: int) -> tuple:
    """All texts streamed at once, one thread each, released together: (results, barrier time)."""
    barrier = threading.Barrier(len(texts) + 1)
    results = [None] * len(texts)

    def client(i):
        results[i] = stream_chat(port, texts[i], max_tokens, barrier)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(texts))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return results, t0


def warm(port: int, clients: int) -> None:
    """Requests of prompts other than the timed ones, one alone, then `clients` at once, so that the
    first pass over the weights and the batched graphs of that width are not timed."""
    stream_chat(port, WARMUP.format(0), 8)
    if clients > 1:
        concurrent(port, [WARMUP.format(i + 1) for i in range(clients)], 8)


def stop_process(proc: subprocess.Popen) -> int:
    """Stop a server process: SIGTERM first (aiohttp shuts down gracefully, the service flushes its
    chunks), SIGKILL if it has not exited within a minute; its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
