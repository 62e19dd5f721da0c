"""Where an engine's forward passes run: the protocol the engine calls, and the runner of one process.

An `Engine` is given its runner when it is made: `LocalRunner` (every layer in this process, the
default) or a pipeline of ranks (`distributed.pipeline.Pipeline`, rank 0's side of a model split by
layers), which `Engine.with_runner` puts under the same loaded model. The engine asks only this
protocol, so its loop has no branch for where the layers are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .errors import ConfigError


class Runner(ABC):
    @abstractmethod
    def forward(self, engine, tokens, caches, all_logits: bool):
        """`engine`'s graph over backend tokens [1, T] with the sequence's `caches`: logits
        [1, T or 1, vocab] as a backend array; the caches advance."""

    @abstractmethod
    def new_sequence(self, caches, tokens: int) -> None:
        """`caches` were made for a new sequence of at most `tokens` tokens."""

    @abstractmethod
    def trim(self, caches, keep: int) -> None:
        """The sequence's caches keep their first `keep` tokens."""

    @abstractmethod
    def free(self, caches) -> None:
        """The sequence is done with."""

    @abstractmethod
    def close(self) -> None:
        """The engine closes."""

    @abstractmethod
    def run_batch(
        self, engine, prompts, max_tokens, opts, policy, progress: bool, on_done=None, kv_bits=(0,), micro_batches=0
    ):
        """The throughput mode over `prompts` (Engine.generate_batch): (every prompt's
        batching.sequence.Sequence in prompt order, the run's stats). policy and kv_bits place weights
        and KV in one process; micro_batches are those in flight across ranks (0: chosen)."""


class LocalRunner(Runner):
    """Every layer in this process: the model module's whole graph in one call, with the FFN source the
    engine holds at the time (a calibration run records through a stand-in for a while)."""

    def forward(self, engine, tokens, caches, all_logits: bool):
        return engine.module.forward(engine.ops, engine.args, engine.weights, tokens, caches, engine.ffn, all_logits)

    def new_sequence(self, caches, tokens: int) -> None:
        pass  # the caches are all there is to a sequence in one process

    def trim(self, caches, keep: int) -> None:
        for c in caches:
            c.trim(c.offset - keep)

    def free(self, caches) -> None:
        pass  # the caller dropping the caches frees them

    def close(self) -> None:
        pass  # the engine closes its FFN source and layer slots itself

    def run_batch(
        self, engine, prompts, max_tokens, opts, policy, progress: bool, on_done=None, kv_bits=(0,), micro_batches=0
    ):
        from .offload.run import run_batch  # deferred: the throughput mode and its LP solver (scipy)

        if micro_batches:
            raise ConfigError(
                "micro_batches applies to a model split across ranks; one process's policy sets its batches"
            )
        return run_batch(engine, prompts, max_tokens, opts, policy, progress, on_done, kv_bits)
