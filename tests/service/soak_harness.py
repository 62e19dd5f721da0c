"""Parts of the killing soak (test_soak_kills.py) that watch the server from outside, with no hook in
the package: the service folder's temporaries (inotify), the cgroup's memory each second, and one
streamed greedy turn of a conversation held on the server.

A swap file or a context record is written to `<file>.tmp-<pid>` and then renamed (durable.py), so
a temporary that exists names a write in progress; the watcher sees it created and, when armed,
SIGKILLs the server from its own thread at once. Whether the kill landed inside the write is decided
afterwards from the disk: the temporary is still there once the process is dead (a rename that won
the race leaves none)."""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import select
import signal
import struct
import threading
import time
import traceback

from live_server import CHAT, HOST, chat_body

IN_MOVED_TO, IN_CREATE, IN_ISDIR, IN_ONLYDIR = 0x80, 0x100, 0x40000000, 0x01000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, length of the name that follows


class TmpWatcher:
    """inotify on `<svc>/contexts` and every context folder in it: counts the temporaries created
    (chunk files and records apart) and, while armed with a pid, SIGKILLs it the moment a chunk
    file's temporary appears, remembering that temporary's path."""

    def __init__(self, contexts: str):
        self.root = contexts
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.folders: dict[int, str] = {}
        self.chunk_writes = self.record_writes = 0
        self._pid: int | None = None
        self.fired = threading.Event()
        self.hit_path: str | None = None
        self.hit_at = 0.0
        self._stop = threading.Event()
        self._watch(contexts)
        for name in os.listdir(contexts):
            self._watch(os.path.join(contexts, name))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _watch(self, folder: str) -> None:
        wd = self._libc.inotify_add_watch(self.fd, folder.encode(), IN_CREATE | IN_MOVED_TO | IN_ONLYDIR)
        if wd >= 0:  # (a folder removed meanwhile: nothing to watch)
            self.folders[wd] = folder

    def arm(self, pid: int) -> None:
        self.fired.clear()
        self.hit_path = None
        self._pid = pid

    def disarm(self) -> None:
        self._pid = None

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if not ready:
                continue
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
            at = 0
            while at < len(buf):
                wd, mask, _, n = _EVENT.unpack_from(buf, at)
                name = buf[at + _EVENT.size : at + _EVENT.size + n].rstrip(b"\0").decode()
                at += _EVENT.size + n
                folder = self.folders.get(wd)
                if folder is None or not name:
                    continue
                path = os.path.join(folder, name)
                if mask & IN_ISDIR:
                    if folder == self.root:
                        self._watch(path)  # a new context's folder
                    continue
                if ".tmp-" not in name or not mask & IN_CREATE:
                    continue
                if name.startswith("chunk-"):
                    self.chunk_writes += 1
                    pid = self._pid
                    if pid is not None and name.endswith(f".tmp-{pid}"):
                        os.kill(pid, signal.SIGKILL)  # first: every instruction before it widens the gap
                        self._pid, self.hit_path, self.hit_at = None, path, time.monotonic()
                        self.fired.set()
                else:
                    self.record_writes += 1

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        os.close(self.fd)


class Sampler:
    """The cgroup's charged bytes (usage_in_bytes: anonymous memory and page cache) and its
    anonymous share (memory.stat total_rss) once a second, from start() to stop()."""

    def __init__(self, cgroup_path: str):
        self.path = cgroup_path
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> tuple[int, int]:
        with open(os.path.join(self.path, "memory.usage_in_bytes")) as fh:
            usage = int(fh.read())
        with open(os.path.join(self.path, "memory.stat")) as fh:
            stat = dict(line.split() for line in fh if line.strip())
        return usage, int(stat.get("total_rss", stat.get("rss", 0)))

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except FileNotFoundError:  # the cgroup is gone (its run failed and it was removed): nothing to sample
                return
            t += 1.0
            self._stop.wait(max(0.0, t - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


class Interrupted(Exception):
    """The connection broke before the answer ended (the server was killed)."""


def stream_turn(port: int, ctx: str, text: str, max_tokens: int, streaming=None) -> tuple[int, object]:
    """One turn of a context, streamed and greedy: (200, the answer's text) or (status, error body).
    streaming(True) once the first token event arrived, streaming(False) when the answer ends or
    breaks. Interrupted when the connection breaks before [DONE]."""
    conn = http.client.HTTPConnection(HOST, port, timeout=600)
    opened = False
    try:
        body = chat_body([{"role": "user", "content": text}], max_tokens=max_tokens, context_id=ctx, stream=True)
        conn.request("POST", CHAT, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raw = r.read().decode(errors="replace")
            try:
                return r.status, json.loads(raw)
            except json.JSONDecodeError:
                return r.status, raw
        parts = []
        while True:
            line = r.readline()
            if not line:
                raise Interrupted("the stream ended before [DONE]")
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                return 200, "".join(parts)
            obj = json.loads(payload)
            if "error" in obj:  # an error after the stream opened: the status line said 200 already
                return 500, obj
            for choice in obj.get("choices") or ():  # (a usage event has none)
                parts.append(choice["delta"].get("content") or "")
            if not opened and streaming is not None:
                opened = True
                streaming(True)
    except (OSError, http.client.HTTPException) as e:
        raise Interrupted(f"{type(e).__name__}: {e}") from None
    finally:
        if opened and streaming is not None:
            streaming(False)
        conn.close()


class Aborted(Exception):
    """The test stopped the clients."""


class Conversation:
    def __init__(self, ctx: str, slot: int):
        self.id, self.slot, self.done = ctx, slot, 0
        self.again = False  # its next turn was being answered when a kill hit: asked again


class Fleet:
    """Clients holding conversations on a server that the test may kill and restart (kill()):
    `start_server()` -> a live_server.Srv; scripts[c][j] = (system prompt, [turn texts]) of client
    c's conversation slot j. A client asks its slots' next turns in turn; a finished conversation is
    begun again in a fresh context (same script, so the same answers). reference: None records the
    answers (a run without kills, one pass of every script); else each answer must equal it."""

    def __init__(self, start_server, scripts, max_tokens: int, reference: dict | None = None):
        self.start_server, self.scripts, self.max_tokens, self.reference = start_server, scripts, max_tokens, reference
        self.srv = start_server()
        self.gen = 0  # servers started after the first
        self.up, self.gate = threading.Event(), threading.Event()
        self.up.set()
        self.gate.set()  # cleared: clients hold before their next request (an idle server)
        self.lock = threading.Lock()
        self.in_flight = self.streaming = 0
        self.known: dict[str, Conversation] = {}
        self.answers: dict[tuple, str] = {}
        self.done_at: list[float] = []
        self.n = dict(ok=0, r503=0, interrupted=0, again=0, again_equal=0, ended_before_kill=0, created=0)
        self.other: list = []  # responses neither 200 nor 503
        self.wrong: list = []  # answers that differ from the reference
        self.lost: list = []  # contexts a restart did not bring back, or whose turns changed
        self.deadline = self.t0 = float("inf")
        self.aborted = False

    # ---- clients --------------------------------------------------------------------------------
    def run_clients(self, seconds: float | None) -> float:
        """Every client until `seconds` pass (None: one pass of its scripts); the seconds it took."""
        t0 = self.t0 = time.monotonic()
        self.deadline = t0 + seconds if seconds is not None else float("inf")
        threads = [threading.Thread(target=self._client, args=(c, seconds is None)) for c in range(len(self.scripts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0

    def _client(self, c: int, once: bool) -> None:
        try:
            self._conversations(c, once)
        except Aborted:
            pass
        except Exception as e:  # a client's own bug fails the test with its traceback, not a silent stop
            with self.lock:
                self.other.append(("client crashed", "".join(traceback.format_exception(e))))

    def _conversations(self, c: int, once: bool) -> None:
        convs: list[Conversation | None] = [None] * len(self.scripts[c])
        while time.monotonic() < self.deadline:
            busy = False
            for j, (system, turns) in enumerate(self.scripts[c]):
                if time.monotonic() >= self.deadline:
                    return
                conv = convs[j]
                if conv is not None and conv.done == len(turns):
                    if once:
                        continue
                    self._delete(conv)  # (the server keeps at most 1024 contexts)
                    conv = None
                if conv is None:
                    conv = convs[j] = self._new_context(system, j)
                    if conv is None:
                        return
                busy = True
                if not self._turn(c, conv, turns[conv.done]):
                    convs[j] = None
            if not busy:
                return

    def _wait(self, gen: int) -> bool:
        """Until a server started after generation `gen` answers (False: none came)."""
        end = time.monotonic() + 300
        while time.monotonic() < end:
            if self.gen > gen and self.up.wait(1.0):
                return True
            time.sleep(0.05)
        return False

    def _ready(self):
        self.gate.wait()
        self.up.wait()
        if self.aborted:
            raise Aborted
        return self.srv, self.gen

    def abort(self) -> None:
        """Stop every client now (the server could not be restarted)."""
        self.aborted, self.deadline = True, 0.0
        self.gen += 1
        self.gate.set()
        self.up.set()

    def _new_context(self, system: str, slot: int) -> Conversation | None:
        while True:
            srv, gen = self._ready()
            try:
                status, _, data = srv.request("POST", "/v1/contexts", {"system": system}, timeout=600)
            except (OSError, http.client.HTTPException) as e:
                if self._wait(gen):
                    continue
                self.other.append(("context creation broke with no kill", repr(e)))
                return None
            if status != 200:
                with self.lock:
                    self.other.append((status, data))
                return None
            conv = Conversation(data["id"], slot)
            with self.lock:
                self.known[conv.id] = conv
                self.n["created"] += 1
            return conv

    def _delete(self, conv: Conversation) -> None:
        """Delete a finished conversation's context (it stops counting as one a restart must keep)."""
        with self.lock:
            del self.known[conv.id]
        while True:
            srv, gen = self._ready()
            try:
                status, _, data = srv.request("DELETE", f"/v1/contexts/{conv.id}", timeout=600)
            except (OSError, http.client.HTTPException):
                if self._wait(gen):
                    continue  # (a 404 then: it was deleted before the kill)
                return
            if status not in (200, 404):
                with self.lock:
                    self.other.append((status, data))
            return

    def _streaming(self, on: bool) -> None:
        with self.lock:
            self.streaming += 1 if on else -1

    def _turn(self, c: int, conv: Conversation, text: str) -> bool:
        """Ask conv's next turn until it is answered; False when the conversation cannot go on."""
        key = (c, conv.slot, conv.done)
        while True:
            srv, gen = self._ready()
            with self.lock:
                self.in_flight += 1
            try:
                status, data = stream_turn(srv.port, conv.id, text, self.max_tokens, self._streaming)
            except Interrupted as e:
                with self.lock:
                    self.n["interrupted"] += 1
                if not self._wait(gen):
                    self.other.append(("a turn broke with no kill", str(e)))
                    return False
                held = self._held(conv)
                if held == conv.done:  # the turn had not ended: it is asked again
                    conv.again = True
                    continue
                if held == conv.done + 1:  # it ended before the kill: the context holds it
                    with self.lock:
                        self.n["ended_before_kill"] += 1
                        self.done_at.append(time.monotonic())
                    conv.done += 1
                    return True
                with self.lock:
                    self.lost.append((conv.id, f"after a kill it holds {held} turns where {conv.done} ended"))
                return False
            finally:
                with self.lock:
                    self.in_flight -= 1
            if status == 503:
                with self.lock:
                    self.n["r503"] += 1
                time.sleep(1.0)  # as Retry-After says
                continue
            if status != 200:
                with self.lock:
                    self.other.append((status, data))
                return False
            return self._answered(key, conv, data)

    def _answered(self, key: tuple, conv: Conversation, text: str) -> bool:
        with self.lock:
            self.n["ok"] += 1
            self.done_at.append(time.monotonic())
            if self.reference is None:
                self.answers[key] = text
            elif text != self.reference.get(key):
                self.wrong.append((key, conv.again, text, self.reference.get(key)))
            if conv.again:
                self.n["again"] += 1
                self.n["again_equal"] += text == (self.reference or {}).get(key)
        conv.again = False
        conv.done += 1
        return True

    def _held(self, conv: Conversation) -> int | None:
        """Turns conv's context holds on the server now (None: it is gone)."""
        while True:
            srv, gen = self._ready()
            try:
                status, _, data = srv.request("GET", f"/v1/contexts/{conv.id}")
            except (OSError, http.client.HTTPException):
                if self._wait(gen):
                    continue
                return None
            return (data["messages"] - 1) // 2 if status == 200 else None  # (the system message, then pairs)
