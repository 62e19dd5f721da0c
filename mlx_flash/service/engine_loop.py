"""The server's engine thread: the only thread that touches the Service, running a continuous
batch (running_batch.py) and, between its steps, everything else asked of the service.

Requests arrive as jobs; up to `max_batch` run at once, the rest wait their turn and join the
batch between decode steps as others leave: first the waiting job of the key (a job's owner) with
the fewest calls running, among equals the key served least recently, then the oldest (arrival
order with one key), so one key's flood does not starve another's requests. Other work (context CRUD, stats)
is a function run between steps. Each job's steps, its usage and an end marker go to its asyncio
queue on the event loop's thread. With nothing to do for IDLE_SWAP_S, the loop writes a few chunks
ahead of need (Service.swap_out_idle).

A failed call answers by its cause (api_error): the request's fault 4xx, the disk's (DiskError) 507
or 500, overload 503, anything else 500 with its traceback printed once (a bug); the loop goes on.
A context the failed request made is deleted again, so a failure leaves no half-made context behind
(one holding chunks that only a write to the full disk could evict).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import sys
import threading
import traceback

from ..errors import ContextLengthError, ContextNotFoundError, DiskError, FlashError, MemoryBudgetError
from . import openai_api as oa
from .running_batch import RunningBatch

IDLE_SWAP_S = 0.5
DONE = object()  # the end of a job's items


class EngineLoop:
    def __init__(self, service, max_batch: int = 32, batch=None):
        """batch: what runs the calls (a running_batch.CallBatch: calls, full, start, step, finish,
        close); default a RunningBatch over the service."""
        self.svc = service
        self.batch = batch if batch is not None else RunningBatch(service, max_batch)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: collections.deque = collections.deque()  # jobs not yet started, in arrival order
        self.active: dict = {}  # BatchedCall -> job
        self.queued = 0  # jobs submitted and not started (read by the event loop for 503s)
        self.queued_by: collections.Counter = collections.Counter()  # the same per key (for 429s)
        self.starts, self.started = 0, {}  # jobs started, and the number of each key's last one
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mlx-flash-engine", daemon=True)

    @property
    def busy(self) -> bool:
        return bool(self.active)

    @property
    def problem(self) -> str | None:
        """Why no request can be answered, or None (a one-process engine has no such state)."""
        return None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Finish running calls, write every chunk without a swap file, end the thread."""
        done = self.call(self._shutdown)
        done.result()
        self.thread.join()

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the engine thread between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((fn, args, fut))
        return fut

    async def run(self, fn, *args):
        return await asyncio.wrap_future(self.call(fn, *args))

    def submit(self, job) -> None:
        self.queued += 1
        self.queued_by[job.owner] += 1
        self.inbox.put(job)

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as e:  # a bug: the running requests fail with 500, the loop goes on
                self._fail_all(e)

    def _turn(self) -> None:
        """Take what arrived, start waiting jobs while the batch has room, run one decode step."""
        idle = not self.batch.calls and not self.waiting
        try:
            item = self.inbox.get(timeout=IDLE_SWAP_S) if idle else self.inbox.get_nowait()
        except queue.Empty:
            item = None
            if idle:
                self._swap_ahead()
                return
        while item is not None:
            self._take(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                item = None
        while self.waiting and not self.batch.full and not self._stop.is_set():
            if not self._begin(self._next_waiting()):
                break  # the KV budget is held by running calls: the job waits for them to finish
        if self.batch.calls:
            self._step()

    def _next_waiting(self):
        """The waiting job of the key with the fewest calls running, among equals the key that
        started one least recently, then the oldest; out of the queue."""
        running = collections.Counter(job.owner for job in self.active.values())
        k = min(
            range(len(self.waiting)),
            key=lambda k: (running[self.waiting[k].owner], self.started.get(self.waiting[k].owner, -1), k),
        )
        job = self.waiting[k]
        del self.waiting[k]
        self.queued -= 1
        self.queued_by[job.owner] -= 1
        self.started[job.owner] = self.starts = self.starts + 1
        return job

    def _take(self, item) -> None:
        if isinstance(item, tuple):
            fn, args, fut = item
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the awaiting request
                fut.set_exception(e)
        else:
            self.waiting.append(item)

    def _swap_ahead(self) -> None:
        try:
            self.svc.swap_out_idle(4)
        except FlashError:
            pass  # a full disk: the chunks stay in memory; a request will meet the error by name

    def _begin(self, job) -> bool:
        """Pick the job's context and start its call; errors end the job with an OpenAI error. A job
        the KV budget cannot hold while other calls run goes back to the head of the queue (False):
        it starts when they have finished, where a 503 would send its client away."""
        svc, req = self.svc, job.req
        made = None  # a context this request made: removed again if the request fails
        try:
            if job.explicit:
                ctx, whole = job.explicit, False
                svc.get(ctx, job.owner)
            else:
                ids = svc.engine.encode_prompt(req.prompt) if req.chat else svc.engine.tokenizer.encode(req.prompt)
                ctx, made = self._context_for(ids, job.owner)
                whole = True
            job.context, job.made = ctx, made is not None
            call, step = self.batch.start(ctx, req.prompt, owner=job.owner, whole=whole, **req.sampling.kwargs())
        except Exception as e:
            if made is not None:
                try:
                    svc.delete(made, job.owner)
                except FlashError:
                    pass
            if isinstance(e, MemoryBudgetError) and self.batch.calls:
                self.waiting.appendleft(job)
                self.queued += 1
                self.queued_by[job.owner] += 1
                return False
            job.put(self._failed(e))
            job.put(DONE)
            return True
        if step is not None:
            job.put(step)
        if call in self.batch.calls:
            self.active[call] = job
        else:
            self._end(call, job)
        return True

    def _context_for(self, ids: list, owner: str) -> tuple[str, str | None]:
        """The context a request without one continues: (its id, the same id if this made it, else
        None). The owner's context sharing the longest prefix with ids, forked where it holds more;
        a new one when none shares any."""
        svc = self.svc
        ctx, n = svc.match(ids, owner)
        if ctx is None:
            ctx = svc.new_context(owner=owner)
            return ctx, ctx
        if n < svc.get(ctx, owner).kv_tokens:
            ctx = svc.fork(ctx, n, owner)
            return ctx, ctx
        return ctx, None

    def _api_error(self, e: Exception) -> oa.ApiError:
        return api_error(e)

    def _failed(self, e: Exception) -> oa.ApiError:
        """The answer to a failure; an unexpected one (not a FlashError: a bug) has its traceback
        printed, once."""
        if not isinstance(e, FlashError):
            traceback.print_exception(e, file=sys.stderr)
        return self._api_error(e)

    def _fail_all(self, e: Exception) -> None:
        """A failed pass (or a bug in the loop) fails every running call; the server stays up."""
        err = self._failed(e)
        for call, job in list(self.active.items()):
            try:
                self.batch.finish(call, failed=True)
            except FlashError:
                pass  # (its record could not be written either: the error on its way names the cause)
            job.put(err)
            self._end(call, job)
            self._forget(job)

    def _forget(self, job) -> None:
        """Delete the context a failed request made (a request's failure leaves none behind)."""
        if job.made:
            job.made = False
            try:
                self.svc.delete(job.context, job.owner)
            except FlashError:
                pass  # (already gone, or in use again: it stays)

    def _step(self) -> None:
        for call, job in list(self.active.items()):
            if job.cancel.is_set():  # the client went away: it stops here, its context keeps what it got
                try:
                    self.batch.finish(call)
                except FlashError as e:  # (its record could not be written: the next call's context says so)
                    job.put(self._failed(e))
                self._end(call, job)
        if not self.batch.calls:
            return
        try:
            results = self.batch.step()
        except Exception as e:  # a failed pass fails every call in it; the server stays up
            self._fail_all(e)
            return
        for call, step in results:
            job = self.active.get(call)
            if job is None:
                continue
            if step is not None:
                job.put(step)
            if call.error is not None:
                job.put(self._failed(call.error))
            if call not in self.batch.calls:
                self._end(call, job)
                if call.error is not None:
                    self._forget(job)

    def _end(self, call, job) -> None:
        self.active.pop(call, None)
        # completion tokens: every token sampled, a closing end-of-sequence token included (the
        # context holds them all but the last, which is what cached_tokens then reuses)
        job.put(oa.usage(call.report.prompt_tokens, len(call.seq.tokens), call.report.cached_tokens))
        job.put(DONE)

    def _shutdown(self) -> None:
        for call, job in list(self.active.items()):
            self.batch.finish(call)
            self._end(call, job)
        while self.waiting:
            job = self.waiting.popleft()
            job.put(oa.ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error"))
            job.put(DONE)
        try:
            self.svc.flush()
        except DiskError as e:  # the records are on flash already; a chunk without a file is recomputed
            print(f"warning: chunks not written at shutdown: {e}", file=sys.stderr, flush=True)
        self._stop.set()


def api_error(e: Exception) -> oa.ApiError:
    """The OpenAI error a failed call answers with: 4xx the request's fault, 5xx the server's."""
    if isinstance(e, ContextNotFoundError):
        return oa.ApiError(404, str(e), "context_id", "context_not_found")
    if isinstance(e, MemoryBudgetError):  # (a ConfigError: room now, not the request, is what lacks)
        return oa.ApiError(503, str(e), code="kv_budget_full", kind="server_error")
    if isinstance(e, ContextLengthError):
        return oa.ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, DiskError):  # the machine's fault: 507 Insufficient Storage for a full disk
        return oa.ApiError(
            507 if e.full else 500, str(e), code="disk_full" if e.full else "disk_error", kind="server_error"
        )
    if isinstance(e, FlashError):
        return oa.ApiError(400, str(e))
    return oa.ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
