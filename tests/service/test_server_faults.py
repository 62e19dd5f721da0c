"""The server's answers by cause, in process (aiohttp's test client over a Server on the real default
model): a full disk under the service folder is 507 naming the file and the cause, not the request's
fault, and once space is back the next new conversation is served without a restart; an unexpected
exception inside the engine is 500 with its traceback printed once, and the server goes on; a
max_tokens beyond the model's context is refused by name, one within it that the prompt leaves no
room for ends with finish_reason "length"; overload is 503 with Retry-After. The status mapping
itself is checked without a model."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

import mlx_flash
from mlx_flash import durable
from mlx_flash.errors import ConfigError, ContextLengthError, ContextNotFoundError, DiskError, MemoryBudgetError
from mlx_flash.service.engine_loop import api_error
from mlx_flash.service.server import Server, ServerOptions

CHAT = "/v1/chat/completions"
KV_BUDGET = "3MB"  # 4 chunks of 16 tokens: a second conversation evicts (writes) the first one's chunks


class FullDisk:
    """`os` as the durable writes see it, on a disk with no room left: os.write fails with ENOSPC."""

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")


def chat(text: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 8, **kw}


def serve(engine, directory, script, **options) -> None:
    """Run `await script(client, service)` against a Server (ServerOptions `options`) over a new
    Service in `directory`."""
    from aiohttp.test_utils import TestClient, TestServer

    svc = mlx_flash.Service(engine, directory=directory, kv_budget=KV_BUDGET)
    server = Server(svc, ServerOptions(model_name="m", **options))

    async def main():
        async with TestClient(TestServer(server.app())) as client:
            await script(client, svc)

    try:
        asyncio.run(main())
    finally:
        svc.close()


async def post(client, body) -> tuple[int, dict]:
    r = await client.post(CHAT, json=body)
    return r.status, await r.json()


def one_line_error(data: dict, kind: str) -> str:
    err = data["error"]
    assert err["type"] == kind, err
    assert err["message"] and "\n" not in err["message"], err
    return err["message"]


@pytest.fixture(scope="module")
def engine(engines, store_dir):
    return engines(store_dir, "torch")


# ---- the mapping, no model -----------------------------------------------------------------------
def disk_error(code: int) -> DiskError:
    """A DiskError as durable.DurableFile makes it of the OSError."""
    return durable.disk_error(DiskError, "/srv/ctx/context.json", OSError(code, os.strerror(code)))


@pytest.mark.parametrize(
    "error, status, kind",
    [
        (disk_error(errno.ENOSPC), 507, "server_error"),
        (disk_error(errno.EDQUOT), 507, "server_error"),
        (DiskError("/srv/x.kv: the disk is full (needs 1 MB, 0 B free)", full=True), 507, "server_error"),
        (disk_error(errno.EROFS), 500, "server_error"),
        (disk_error(errno.EIO), 500, "server_error"),
        (MemoryBudgetError("the KV budget cannot hold 3 more chunks"), 503, "server_error"),
        (ContextLengthError("the context would hold 9000 tokens"), 400, "invalid_request_error"),
        (ConfigError("temperature must be a number"), 400, "invalid_request_error"),
        (ContextNotFoundError("context abc does not exist"), 404, "invalid_request_error"),
        (RuntimeError("a bug"), 500, "server_error"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_status_by_cause(error, status, kind):
    e = api_error(error)
    assert (e.status, e.kind) == (status, kind), (error, e.status, e.kind)
    assert str(error) in str(e)


# ---- a full disk ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_full_disk_is_507_and_space_back_serves_the_next_conversation(engine, tmp_path, monkeypatch):
    directory = str(tmp_path / "svc")

    async def script(client, svc):
        status, data = await post(client, chat("What is the capital of France?"))
        assert status == 200 and "Paris" in data["choices"][0]["message"]["content"], data
        held = set(svc.contexts)
        monkeypatch.setattr(durable, "os", FullDisk())
        for text in ("Name a color.", "Tell me a joke about cats.", "What is two plus two?"):
            status, data = await post(client, chat(text))
            msg = one_line_error(data, "server_error")
            assert status == 507 and data["error"]["code"] == "disk_full", (status, data)
            assert "the disk is full" in msg and directory in msg, msg  # the file, and the cause
            assert set(svc.contexts) == held  # a failed request leaves no context behind
            assert not any(c.pinned for c in svc.contexts.values())
        monkeypatch.undo()  # space again: the next new conversation is served, no restart
        for text in ("Name a color.", "Tell me a joke about cats."):
            status, data = await post(client, chat(text))
            assert status == 200 and data["choices"][0]["message"]["content"], (status, data)
        assert (await client.get("/health")).status == 200

    serve(engine, directory, script)
    # and every context the server holds has its record on flash
    other = mlx_flash.Service(engine, directory=directory, kv_budget=KV_BUDGET)
    try:
        assert len(other.contexts) == 3 and other.problems == [], other.problems
    finally:
        other.close()


# ---- a bug inside the engine -----------------------------------------------------------------------
@pytest.mark.slow
def test_unexpected_error_is_500_with_one_traceback_and_the_server_goes_on(engine, tmp_path, monkeypatch, capfd):
    def broken(messages):
        raise RuntimeError("encode_prompt broke")

    async def script(client, svc):
        monkeypatch.setattr(svc.engine, "encode_prompt", broken)
        status, data = await post(client, chat("What is the capital of France?"))
        msg = one_line_error(data, "server_error")
        assert status == 500 and "encode_prompt broke" in msg, (status, data)
        monkeypatch.undo()
        status, data = await post(client, chat("What is the capital of France?"))
        assert status == 200 and "Paris" in data["choices"][0]["message"]["content"], data

    serve(engine, str(tmp_path / "svc"), script)
    err = capfd.readouterr().err
    assert err.count("Traceback") == 1 and "RuntimeError: encode_prompt broke" in err, err


# ---- max_tokens and the model's context -----------------------------------------------------------
@pytest.mark.slow
def test_max_tokens_beyond_the_context_is_refused_within_it_cut_at_length(engine, tmp_path):
    context = engine.model_context

    async def script(client, svc):
        for field in ("max_tokens", "max_completion_tokens"):
            body = {"messages": [{"role": "user", "content": "Hi"}], field: 10**12}
            status, data = await post(client, body)
            msg = one_line_error(data, "invalid_request_error")
            assert status == 400 and data["error"]["param"] == field, (status, data)
            assert msg == f"{field} 1000000000000 is more than the model's context ({context} tokens)", msg
        status, data = await post(client, chat("Hi", max_tokens=context + 1))
        assert status == 400 and f"({context} tokens)" in data["error"]["message"], data
        assert svc.contexts == {}  # refused before any context is made
        # Within the context, more than the KV left after the prompt: cut there, finish_reason "length".
        room = svc.max_tokens
        assert room < context
        status, data = await post(client, chat("Write a very long story about a dragon.", max_tokens=context))
        assert status == 200, data
        u = data["usage"]
        assert data["choices"][0]["finish_reason"] == "length", data
        assert u["prompt_tokens"] + u["completion_tokens"] <= room, (u, room)
        assert u["completion_tokens"] >= room - u["prompt_tokens"] - 1, (u, room)

    serve(engine, str(tmp_path / "svc"), script)


# ---- overload -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_overload_is_503_with_retry_after(engine, tmp_path):
    async def script(client, svc):
        r = await client.post(CHAT, json=chat("What is the capital of France?"))
        data = await r.json()
        assert r.status == 503 and r.headers.get("Retry-After") == "1", (r.status, dict(r.headers))
        assert data["error"]["code"] == "overloaded" and "retry later" in one_line_error(data, "server_error")

    serve(engine, str(tmp_path / "svc"), script, queue_limit=0)  # every request finds the queue full
