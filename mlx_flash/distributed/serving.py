"""The server's engine thread for a model split across ranks (`python -m mlx_flash.serve --pipeline`):
the loop protocol the HTTP layer calls (service/server.py: start, stop, run, submit, queued, active,
busy, problem), over the conversations every rank holds (conversations.py).

Requests run one at a time, in arrival order (the one-process server's continuous batch is not
built across ranks); a request without a context continues the owner's conversation sharing the
longest prefix with it, or starts one. Once a rank dies or stalls, the request running gets 503
naming it, and so does every later one, and /health answers 503: the server stays up to say so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading

from ..errors import PipelineFault
from ..service import openai_api as oa
from ..service.engine_loop import DONE, api_error


class PipelineLoop:
    def __init__(self, conversations):
        self.svc = conversations
        self.inbox: queue.Queue = queue.Queue()
        self.queued = 0  # jobs submitted and not started (read by the event loop for 503s)
        self.active: dict = {}  # id of the job running -> the job
        self.thread = threading.Thread(target=self._run, name="mlx-flash-engine", daemon=True)
        # a stalled rank: the request waiting on it gets 503 now (this thread stays blocked in the wait)
        conversations.engine.pipeline.report_stalls_to(self._stalled)

    @property
    def busy(self) -> bool:
        return bool(self.active)

    @property
    def problem(self) -> str | None:
        """Why no request can be answered (a broken pipeline), or None."""
        return self.svc.engine.pipeline.broken

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join(None if self.problem is None else 5.0)  # (after a stall the thread may never return)

    def call(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((fn, args, fut))
        return fut

    async def run(self, fn, *args):
        if self.problem is not None:  # (after a stall the engine thread is stuck in its wait)
            raise stopped(self.problem)
        return await asyncio.wrap_future(self.call(fn, *args))

    def submit(self, job) -> None:
        self.queued += 1
        self.inbox.put(job)

    def _stalled(self, message: str) -> None:
        """From the pipeline's watchdog: the request waiting on a stalled rank ends with 503."""
        for job in list(self.active.values()):
            job.put(stopped(message))
            job.put(DONE)

    def _run(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            if isinstance(item, tuple):
                fn, args, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as e:  # handed to the awaiting request
                        fut.set_exception(e)
                continue
            self.queued -= 1
            self._serve(item)

    def _serve(self, job) -> None:
        svc, req = self.svc, job.req
        made, sampled = None, 0
        try:
            if self.problem is not None:
                raise PipelineFault(self.problem)
            if job.explicit:
                ctx, whole = job.explicit, False
                svc.get(ctx, job.owner)
            else:
                ids = svc.engine.encode_prompt(req.prompt) if req.chat else svc.engine.tokenizer.encode(req.prompt)
                ctx = svc.match(ids, job.owner) or svc.new_context(owner=job.owner)
                made = ctx if not svc.get(ctx, job.owner).held else None
                whole = True
            job.context = ctx
            self.active[id(job)] = job
            steps = svc.call(ctx, req.prompt, job.owner, whole=whole, **req.sampling.kwargs())
            for step in steps:
                sampled += 1
                job.put(step)
                if job.cancel.is_set():  # the client went away: it stops here
                    steps.close()
                    break
            job.put(oa.usage(svc.engine.last.prompt_tokens, sampled, svc.engine.last.cached_tokens))
        except PipelineFault as e:
            job.put(stopped(str(e)))
        except Exception as e:  # noqa: BLE001 - every failure reaches the client as an OpenAI error
            if made is not None and self.problem is None:
                try:
                    svc.delete(made, job.owner)
                except Exception:  # noqa: BLE001 - the request's error is the one to report
                    pass
            job.put(api_error(e))
        finally:
            self.active.pop(id(job), None)
            job.put(DONE)


def stopped(message: str) -> oa.ApiError:
    """The answer to a request a broken pipeline cannot serve."""
    return oa.ApiError(503, message, code="pipeline_stopped", kind="server_error")
