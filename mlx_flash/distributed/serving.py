"""The server's engine thread for a model split across ranks (`python -m mlx_flash.serve --pipeline`):
the one-process server's engine loop (service/engine_loop.py: requests wait in arrival order and
join a continuous batch between decode steps, up to --max-batch at once) driving the continuous
batch across ranks (running_batch.py) over the conversations every rank holds (conversations.py).

A request without a context continues the owner's idle conversation sharing the longest prefix
with it, or starts one. Once a rank dies or stalls, the requests running get 503 naming it, and so
does every later one, and /health answers 503: the server stays up to say so.
"""

from __future__ import annotations

import concurrent.futures

from ..errors import PipelineFault
from ..service import Service
from ..service import openai_api as oa
from ..service.engine_loop import DONE, api_error
from ..service.sequence_batch import SequenceLoop
from ..service.sequences import TieredConversations
from ..service.server import Server, ServerOptions
from .conversations import PipelineConversations
from .pipeline import Pipeline
from .running_batch import PipelineRunningBatch


def conversations_for(engine, long: bool = False, **service_options):
    """What holds a command's conversations: on a model split across ranks, each conversation's KV on
    every rank (PipelineConversations: the service options are a one-process service's); with `long`
    (`serve --long-context`: one conversation at a time) and a plan that keeps a long sequence's older KV on
    flash, one conversation's whole context (TieredConversations); else an in-process Service made
    with `service_options`, its contexts in the KV share's chunks."""
    if isinstance(engine.runner, Pipeline):
        return PipelineConversations(engine)
    if long and engine.kv_tiers is not None:
        return TieredConversations(engine)
    return Service(engine, **service_options)


def server_for(conversations, options: ServerOptions) -> Server:
    """The OpenAI-compatible server over conversations_for()'s conversations, with the engine loop
    that drives them."""
    if isinstance(conversations, PipelineConversations):
        return Server(conversations, options, PipelineLoop(conversations, options.max_batch))
    if isinstance(conversations, TieredConversations):  # one conversation's caches at a time: one call
        return Server(conversations, options, SequenceLoop(conversations, 1))
    return Server(conversations, options)


def model_store_path(engine) -> str:
    """The store the model was loaded from: on a pipeline's rank 0, the whole model's, which its stage
    store was cut from."""
    return engine.runner.store_path if isinstance(engine.runner, Pipeline) else engine.store.path


class PipelineLoop(SequenceLoop):
    def __init__(self, conversations, max_batch: int = 32):
        super().__init__(conversations, max_batch, PipelineRunningBatch(conversations, max_batch))
        self._starting = None  # the job whose call is being started (its prompt prefilled), not yet active
        # a stalled rank: the requests waiting on it get 503 now (this thread stays blocked in the wait)
        conversations.engine.runner.report_stalls_to(self._stalled)

    @property
    def problem(self) -> str | None:
        """Why no request can be answered (a broken pipeline), or None."""
        return self.svc.engine.runner.broken

    def stop(self) -> None:
        """As the one-process loop stops, but not waiting on a thread a stalled rank holds."""
        done = self.call(self._shutdown)
        while True:
            try:
                done.result(timeout=0.5)
                break
            except concurrent.futures.TimeoutError:
                if self.problem is not None:
                    break
        self.thread.join(None if self.problem is None else 5.0)

    async def run(self, fn, *args):
        if self.problem is not None:  # (after a stall the engine thread is stuck in its wait)
            raise stopped(self.problem)
        return await super().run(fn, *args)

    def _begin(self, job) -> None:
        if self.problem is not None:
            job.put(stopped(self.problem))
            job.put(DONE)
            return
        self._starting = job
        try:
            super()._begin(job)
        finally:
            self._starting = None

    def _api_error(self, e: Exception) -> oa.ApiError:
        if isinstance(e, PipelineFault) or self.problem is not None:
            return stopped(self.problem or str(e))
        return api_error(e)

    def _stalled(self, message: str) -> None:
        """From the pipeline's watchdog: the requests waiting on a stalled rank end with 503."""
        starting = self._starting
        for job in list(self.active.values()) + ([starting] if starting is not None else []):
            job.put(stopped(message))
            job.put(DONE)


def stopped(message: str) -> oa.ApiError:
    """The answer to a request a broken pipeline cannot serve."""
    return oa.ApiError(503, message, code="pipeline_stopped", kind="server_error")
