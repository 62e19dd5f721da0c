"""The OpenAI-compatible HTTP server over a Service (aiohttp).

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events or not),
GET /v1/models, GET /health, GET /v1/stats, and /v1/contexts (POST create, GET list, GET/DELETE
/v1/contexts/{id}).

Contexts, two ways. Explicit: a request naming a context (`context_id` field or `X-Context-Id`
header) appends its messages (or prompt text) to that context: send only the new turn.
Automatic: a request without one is matched, token by token, against the stored contexts of its
API key; one whose whole KV is a prefix of the request continues in place (a stateless client
re-sending a growing history pays only for the new turn), a shorter shared prefix of whole chunks
is forked copy-on-write into a new context, and no match starts a new one. Either way the
response's `X-Context-Id` header names the context used, and `usage.prompt_tokens_details.
cached_tokens` counts the prompt tokens served from it.

One engine thread (engine_loop.py) runs the service with continuous batching: up to `max_batch`
requests decode together, one batched pass of the weights per token for all of them, joining and
leaving between steps; more wait their turn in arrival order. While `queue_limit` requests already
wait, a new one gets 503 with Retry-After, as does a request the KV budget cannot hold right now. A
client that disconnects stops its generation at the next token, with one line on stderr (an ordinary
end, no traceback). Idle time writes chunks to flash ahead of need (Service.swap_out_idle).

Status codes by cause (engine_loop.api_error): the request's fault 4xx (a bad field, a prompt or a
max_tokens beyond the model's context 400, an unknown context 404); the machine's 5xx of OpenAI's
type "server_error": a full disk 507, another disk failure 500, both naming the file and the cause;
overload 503 with Retry-After; anything else 500, its traceback printed once (a bug).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
from dataclasses import dataclass, field

from aiohttp import web

from ..errors import ConfigError, ContextNotFoundError
from ..memory import peak_rss, process_rss
from ..stats import sparsity_stats
from . import openai_api as oa
from .engine_loop import DONE, EngineLoop


@dataclass
class ServerOptions:
    model_name: str
    api_keys: tuple[str, ...] = ()
    queue_limit: int = 16
    max_tokens_default: int = 256
    max_body_bytes: int = 8 << 20
    max_batch: int = 32  # requests decoded together
    key_queue_limit: int | None = None  # requests one API key may have waiting (quota.KeyQuota.queued)


@dataclass
class _Job:
    req: oa.Request
    owner: str
    explicit: str | None
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    context: str = ""
    made: bool = False  # the context was made for this request (deleted again if it fails)

    def put(self, item) -> None:
        """Hand an item to the request's coroutine (from the engine thread)."""
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class Server:
    def __init__(self, service, options: ServerOptions, loop=None):
        """service: a Service (or a model split across ranks: distributed.conversations); loop: its
        engine thread (default: an EngineLoop's continuous batch; distributed.serving.PipelineLoop)."""
        self.svc, self.opt = service, options
        self.engine = loop or EngineLoop(service, options.max_batch)
        self._keys = {hashlib.sha256(k.encode()).hexdigest()[:32]: k for k in options.api_keys}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.opt.max_body_bytes, middlewares=[self._errors])
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/v1/stats", self.stats)
        r.add_post("/v1/contexts", self.create_context)
        r.add_get("/v1/contexts", self.list_contexts)
        r.add_get("/v1/contexts/{id}", self.get_context)
        r.add_delete("/v1/contexts/{id}", self.delete_context)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    # ---- plumbing -------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except oa.ApiError as e:
            return _error(e)
        except web.HTTPException as e:  # aiohttp's own (404 route, 405, 413 body too large)
            if e.status < 400:
                raise
            return _error(oa.ApiError(e.status, e.reason or "error", code=str(e.status)))

    async def _start(self, app) -> None:
        self.engine.start()

    async def _stop(self, app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    def _owner(self, request) -> str:
        if not self._keys:
            return ""
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.startswith("Bearer ") else ""
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        if not key or digest not in self._keys:
            raise oa.ApiError(
                401,
                "missing or wrong API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
                kind="authentication_error",
            )
        return digest

    async def _json(self, request):
        try:
            raw = await request.read()
            return json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise oa.ApiError(400, f"the request body is not valid JSON ({e})") from None

    async def _on_worker(self, fn, *args):
        """Run fn on the engine's thread, between decode steps."""
        return await self.engine.run(fn, *args)

    # ---- generation -----------------------------------------------------------------------------
    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def _generate(self, request, chat: bool):
        owner = self._owner(request)
        req = oa.parse_request(await self._json(request), chat, self.opt.max_tokens_default)
        if req.model not in (None, self.opt.model_name):
            raise oa.ApiError(
                404,
                f"model {req.model!r} does not exist (this server runs {self.opt.model_name!r})",
                "model",
                "model_not_found",
            )
        oa.check_max_tokens(req, self.svc.engine.model_context)
        explicit = req.context_id or request.headers.get("X-Context-Id")
        if self.engine.problem is not None:  # (a pipeline whose rank stalled: its engine thread is stuck)
            raise oa.ApiError(503, self.engine.problem, code="pipeline_stopped", kind="server_error")
        if self.engine.queued >= self.opt.queue_limit:
            raise oa.ApiError(
                503,
                f"{self.engine.queued} requests are already waiting; retry later",
                code="overloaded",
                kind="server_error",
            )
        waiting = self.engine.queued_by[owner]
        if self.opt.key_queue_limit is not None and waiting >= self.opt.key_queue_limit:
            raise oa.ApiError(
                429,
                f"this API key has {waiting} requests waiting already (its quota); retry later",
                code="key_queue_full",
                kind="rate_limit_error",
            )
        job = _Job(req, owner, explicit, asyncio.get_running_loop(), asyncio.Queue())
        self.engine.submit(job)
        try:
            first = await job.out.get()
            if isinstance(first, oa.ApiError):
                return _error(first)
            return await (self._stream(request, job, first) if req.stream else self._collect(request, job, first))
        finally:
            job.cancel.set()  # a disconnect (or any exit) stops the generation at its next token

    async def _items(self, job: _Job, first):
        item = first
        while item is not DONE:
            yield item
            item = await job.out.get()

    async def _collect(self, request, job: _Job, first):
        text, finish, use = [], None, None
        async for item in self._items(job, first):
            if isinstance(item, oa.ApiError):
                return _error(item)
            if isinstance(item, dict):  # the usage, last
                use = item
                continue
            text.append(item.text)
            finish = item.finish_reason or finish
            if not job.cancel.is_set() and (request.transport is None or request.transport.is_closing()):
                job.cancel.set()
                _disconnected(request, job, len(text))
        rid = oa.new_id(job.req.chat)
        body = oa.completion(job.req, rid, self.opt.model_name, "".join(text), finish, use)
        return web.json_response(body, headers={"X-Context-Id": job.context})

    async def _stream(self, request, job: _Job, first):
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Context-Id": job.context}
        )
        rid, model, opened, sent = oa.new_id(job.req.chat), self.opt.model_name, False, 0

        async def send(obj):
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        try:
            await resp.prepare(request)
            async for item in self._items(job, first):
                if isinstance(item, oa.ApiError):
                    await send(item.body())
                    break
                if isinstance(item, dict):  # the usage, last
                    if job.req.include_usage:
                        await send(oa.chunk(job.req, rid, model, None, None, use=item))
                    continue
                await send(oa.chunk(job.req, rid, model, item.text, item.finish_reason, first=not opened))
                opened, sent = True, sent + 1
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # (aiohttp's ClientConnectionResetError) the client went away
            job.cancel.set()
            _disconnected(request, job, sent)
        except asyncio.CancelledError:
            job.cancel.set()
            raise
        return resp

    # ---- other endpoints ------------------------------------------------------------------------
    async def models(self, request):
        self._owner(request)
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.opt.model_name, "object": "model", "created": 0, "owned_by": "mlx_flash"}],
            }
        )

    async def health(self, request):
        problem = self.engine.problem
        if problem is not None:
            return web.json_response({"status": "unavailable", "error": problem}, status=503)
        return web.json_response({"status": "ok"})

    async def stats(self, request):
        self._owner(request)
        sections = await self._on_worker(self.svc.stats_sections)
        plan = self.svc.engine.memory_plan
        return web.json_response(
            {
                **sections,
                "memory": {
                    "limit": plan.get("limit"),
                    "limit_meaning": plan.get("limit_meaning"),
                    "held": process_rss(),
                    "peak": peak_rss(),
                    "plan": plan,
                    **sections.get("memory", {}),
                },
                "sparsity": sparsity_stats(self.svc.engine),
                "queue": {
                    "waiting": self.engine.queued,
                    "running": len(self.engine.active),
                    "busy": self.engine.busy,
                    "limit": self.opt.queue_limit,
                    "max_batch": self.opt.max_batch,
                },
            }
        )

    async def create_context(self, request):
        owner = self._owner(request)
        body = await self._json(request)
        if not isinstance(body, dict) or set(body) - {"system"}:
            raise oa.ApiError(400, "a context takes only an optional 'system' string")
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise oa.ApiError(400, "system must be a string", "system")
        ctx = await self._on_worker(self.svc.new_context, system, owner)
        return web.json_response({"id": ctx, "object": "context"}, headers={"X-Context-Id": ctx})

    async def list_contexts(self, request):
        owner = self._owner(request)
        data = await self._on_worker(self.svc.list, owner)
        return web.json_response({"object": "list", "data": [{"object": "context", **d} for d in data]})

    async def get_context(self, request):
        owner = self._owner(request)
        ctx = request.match_info["id"]
        try:
            d = await self._on_worker(lambda: self.svc.describe(self.svc.get(ctx, owner)))
        except ContextNotFoundError as e:
            raise oa.ApiError(404, str(e), "id", "context_not_found") from None
        return web.json_response({"object": "context", **d})

    async def delete_context(self, request):
        owner = self._owner(request)
        ctx = request.match_info["id"]
        try:
            await self._on_worker(self.svc.delete, ctx, owner)
        except ContextNotFoundError as e:
            raise oa.ApiError(404, str(e), "id", "context_not_found") from None
        except ConfigError as e:
            raise oa.ApiError(409, str(e), "id") from None
        return web.json_response({"id": ctx, "object": "context", "deleted": True})


def _disconnected(request, job: _Job, sent: int) -> None:
    """One line on stderr for a client gone before its answer ended: an ordinary end, not a fault."""
    print(
        f"client disconnected: {request.method} {request.path} (context {job.context or '-'}) after {sent} "
        "tokens sent; its generation stopped",
        file=sys.stderr,
        flush=True,
    )


def _error(e: oa.ApiError) -> web.Response:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return web.json_response(e.body(), status=e.status, headers=headers)
