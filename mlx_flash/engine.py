"""Prefill + decode loop with explicit caches and per-token stats.

The engine owns a backend, the resident weights, an FFN source (ffn_source: resident, streamed,
sparse or experts; it calls only the protocol), the tokenizer and its runner (runner.py: where the
forward passes run, this process or a pipeline of ranks); KV caches are created per generation and
passed to the graph explicitly.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from .batching.finishing import TextStream
from .batching.sequence import SamplingOptions
from .errors import ConfigError, ContextLengthError
from .ffn_source import FFNSource
from .generation import GenerationStep, GenerationSummary, TokenStats, prompt_ids
from .models.cache import make_caches
from .models.kv_tiers import TierPlan, TierReads, make_tiered_caches
from .runner import LocalRunner, Runner
from .sampling import check_generation, check_sampling, check_seed, sample, stop_strings
from .speculative import accepted_prefix, ngram_draft


def model_context(args) -> int:
    """Most tokens one sequence may hold in the model: its positions, or its sliding-window size
    (sliding-window attention is not implemented, so longer contexts are refused)."""
    window = args.sliding_window
    return min(args.max_position_embeddings, window or args.max_position_embeddings)


class Engine:
    def __init__(
        self,
        ops,
        module,
        args,
        weights,
        ffn: FFNSource,
        tokenizer,
        config,
        store,
        memory_plan: dict | None = None,
        kv_tokens: int | None = None,
        layer_slots=None,
        runner: Runner | None = None,
        kv_tiers: TierPlan | None = None,
        thresholded: list | tuple = (),
    ):
        self.ops = ops
        self.module = module
        self.args = args
        self.weights = weights
        self.ffn = ffn
        self.tokenizer = tokenizer
        self.config = config
        self.store = store
        self.memory_plan = dict(memory_plan or {})  # how the planner split memory_budget (mlx_flash.memory_plan)
        self.kv_tokens = kv_tokens  # tokens the memory plan holds KV for (None: the model's context)
        self.layer_slots = layer_slots  # streamed layers' buffers (layer_stream.LayerSlots) or None
        # where the forward passes run: every layer here, or a pipeline of ranks (distributed.pipeline)
        self.runner = runner or LocalRunner()
        # one sequence's older KV on flash when the plan holds fewer tokens resident than its context
        self.kv_tiers = kv_tiers
        # products behind activation-sparsity thresholds (backends/thresholded.py), for their counters
        self.thresholded = tuple(thresholded)
        self._tier_reads: TierReads | None = None  # their read buffers, made at the first such sequence
        self.last = GenerationSummary()
        self.last_batch = None  # the stats of the last generate_batch (offload.run.BatchRun)

    def with_runner(self, runner: Runner) -> "Engine":
        """The same loaded model, its forward passes run by `runner` (rank 0 of a pipeline: its own
        layers through this engine, the others' on their ranks)."""
        return Engine(
            self.ops,
            self.module,
            self.args,
            self.weights,
            self.ffn,
            self.tokenizer,
            self.config,
            self.store,
            self.memory_plan,
            self.kv_tokens,
            self.layer_slots,
            runner,
            self.kv_tiers,
            self.thresholded,
        )

    # ---- model calls ----------------------------------------------------------------------------
    def new_caches(self, tokens: int | None = None):
        """Fresh KV caches for a new sequence (a sparse FFN source also forgets its neuron windows),
        for at most `tokens` tokens (default: the context limit; the buffers grow as it fills). More
        tokens than the plan holds resident: KV tiers (models/kv_tiers.py), whose read buffers the
        engine's sequences share, so such a sequence runs alone (never in a BatchKV with another)."""
        self.ffn.reset()
        tokens = min(tokens or self.context_limit, self.context_limit)
        tiers = self.kv_tiers
        if tiers is not None and tokens > tiers.resident:
            if self._tier_reads is None:
                self._tier_reads = TierReads(self.ops, tiers)
            caches = make_tiered_caches(self.ops, tiers, self._tier_reads)
        else:
            caches = make_caches(self.args.num_hidden_layers, tokens)
        self.runner.new_sequence(caches, tokens)
        return caches

    @property
    def kv_bytes_read(self) -> int:
        """Bytes of KV read back from flash (KV tiers) since load."""
        return self._tier_reads.bytes_read if self._tier_reads is not None else 0

    @property
    def model_context(self) -> int:
        return model_context(self.args)

    @property
    def context_limit(self) -> int:
        """Most tokens one sequence may hold: the model's context, or fewer when the memory plan
        holds KV for fewer (the `context` option)."""
        held = self.kv_tiers.context if self.kv_tiers is not None else self.kv_tokens
        return min(self.model_context, held or self.model_context)

    def disk_shortage(self, limit: int) -> str | None:
        """Why a sequence holds at most `limit` tokens when it is the disk of the KV tiers' folder (the
        plan cut the context for want of it: memory/process_plan.plan_tiers); None otherwise."""
        short = self.memory_plan.get("kv_disk_short")
        return short if short and limit == self.context_limit < self.model_context else None

    def context_words(self, limit: int) -> str:
        """Why a sequence holds at most `limit` tokens: the model's context, or the disk."""
        return self.disk_shortage(limit) or f"the model's context is {limit}"

    def forward(self, ids, caches, all_logits: bool = False) -> np.ndarray:
        """ids (list of int) -> logits [T or 1, vocab] as float32 numpy; advances `caches`."""
        n = caches[0].offset + len(ids)
        if n > self.model_context:
            raise ContextLengthError(f"{n} tokens exceed the model's context of {self.model_context} tokens")
        room = caches[0].capacity
        if room is not None and n > room:
            raise ContextLengthError(
                f"{n} tokens exceed the {room} tokens {caches[0].holds} (the model takes {self.model_context})"
            )
        with self.ops.inference():
            return self.ops.to_numpy(self.runner.forward(self, self.ops.tokens(ids), caches, all_logits))[0]

    def prefill(self, ids, caches, all_logits: bool = False) -> np.ndarray:
        """Run the prompt in chunks of config.prefill_chunk tokens; returns logits of the last token
        (or of every token with all_logits)."""
        chunk = self.config.prefill_chunk
        outs = []
        for s in range(0, len(ids), chunk):
            logits = self.forward(ids[s : s + chunk], caches, all_logits)
            outs.append(logits)
        return np.concatenate(outs, 0) if all_logits else outs[-1][-1]

    def logits(self, ids) -> np.ndarray:
        """Logits for every position of `ids` [T, vocab] (fresh caches)."""
        caches = self.new_caches()
        try:
            return self.prefill(list(ids), caches, all_logits=True)
        finally:
            self.release(caches)

    def release(self, caches) -> None:
        """Caches this engine made are done with: a pipeline's other ranks drop theirs (elsewhere the
        caller dropping them is enough)."""
        self.runner.free(caches)

    # ---- generation -----------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> list[int]:
        """The prompt's token ids: a string as it is, chat messages through the chat template."""
        return prompt_ids(self.tokenizer, prompt)

    def stream_generate(
        self,
        prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop=None,
        speculative: int = 0,
    ) -> Iterator[GenerationStep]:
        """Yield one GenerationStep per generated token. A str prompt is a raw completion; a list of
        messages goes through the model's chat template. speculative=λ > 0 (greedy only) drafts λ
        tokens by prompt lookup and verifies them in one pass; the output is the greedy output."""
        ids = self.encode_prompt(prompt)
        yield from self.stream_tokens(ids, None, max_tokens, temperature, top_p, top_k, seed, stop, speculative)

    def stream_tokens(
        self,
        ids: list[int],
        caches=None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop=None,
        speculative: int = 0,
    ) -> Iterator[GenerationStep]:
        """stream_generate over token ids. `caches` (KV-cache protocol, models/cache.py) may already
        hold a prefix of `ids` (their offset; fewer than len(ids)): only the rest is prefilled. None:
        fresh caches. The caches end holding ids and every generated token but the last."""
        check_generation(max_tokens, temperature, top_p, top_k, seed, stop, speculative)
        opts = SamplingOptions.of(temperature, top_p, top_k, seed, stop)
        if not ids:
            raise ConfigError("the prompt encodes to zero tokens")
        limit = (
            self.context_limit if caches is None else min(self.model_context, caches[0].capacity or self.model_context)
        )
        if len(ids) >= limit:
            raise ContextLengthError(f"the prompt has {len(ids)} tokens; {self.context_words(limit)}")
        max_tokens = min(max_tokens, limit - len(ids))
        cached = caches[0].offset if caches is not None else 0
        if not 0 <= cached < len(ids):
            raise ValueError(f"the caches hold {cached} tokens; a prompt of {len(ids)} needs fewer")
        summary = self.last = GenerationSummary(prompt_tokens=len(ids), cached_tokens=cached)
        if max_tokens == 0:
            return
        own = caches is None  # made here: released when the answer ends
        if own:
            caches = self.new_caches()
        else:
            self.ffn.reset()  # a sparse FFN's neuron windows follow one sequence
        try:
            yield from self._steps(ids, caches, max_tokens, opts, speculative, summary, limit, cached)
        finally:
            if own:
                self.release(caches)

    def _steps(
        self, ids, caches, max_tokens: int, opts: SamplingOptions, speculative: int, summary, limit: int, cached: int
    ) -> Iterator[GenerationStep]:
        t0 = time.perf_counter()
        logits = self.prefill(ids[cached:], caches)
        summary.prefill_s = time.perf_counter() - t0
        io0 = self.io_counters()
        stream = TextStream(self.tokenizer.detokenizer(ids))  # the finishing rules every batch uses too
        eos = self.tokenizer.eos_token_ids
        tokens = (
            self._speculative_tokens(ids, logits, caches, speculative, summary, limit)
            if speculative
            else self._sampled_tokens(logits, caches, opts)
        )
        for n in range(max_tokens):
            t_start = time.perf_counter()
            token = next(tokens)
            stream.add(token, eos, opts.stop, last=n + 1 == max_tokens)
            stats = self._step_stats(t_start, io0)
            io0 = self.io_counters()
            summary.steps.append(stats)
            summary.tokens.append(token)
            summary.generated_tokens += not stream.ended_on_eos
            summary.decode_s += time.perf_counter() - t_start
            yield GenerationStep(stream.delta(opts.stop), token, stats, stream.finish_reason)
            if stream.done:
                return

    def _sampled_tokens(self, logits, caches, opts: SamplingOptions) -> Iterator[int]:
        """One token per forward pass. Lazy: the pass for token n runs when token n+1 is asked for,
        so the last token costs none."""
        rng = np.random.default_rng(opts.seed)
        while True:
            token = sample(logits, opts.temperature, opts.top_p, opts.top_k, rng)
            yield token
            logits = self.forward([token], caches)[-1]

    def _speculative_tokens(self, ids, logits, caches, lam: int, summary, limit: int) -> Iterator[int]:
        """Greedy tokens, several per forward pass when the prompt-lookup draft is right: the pass
        over [last token, draft...] yields the verifier's greedy pick after each prefix; the agreed
        prefix is kept, the cache forgets the rest, and the first disagreement is the next token."""
        context = list(ids)
        token = int(np.argmax(logits))
        while True:
            yield token
            context.append(token)
            room = limit - caches[0].offset - 1
            draft = ngram_draft(context, min(lam, max(room, 0)))
            greedy = self.forward([token] + draft, caches, all_logits=True).argmax(-1).tolist()
            a = accepted_prefix(draft, greedy)
            if a < len(draft):
                self._trim(caches, len(draft) - a)
            summary.draft_proposed += len(draft)
            summary.draft_accepted += a
            for t in draft[:a]:
                yield t
                context.append(t)
            token = greedy[a]

    def _trim(self, caches, n: int) -> None:
        """Forget the last n tokens of a sequence's caches (on every rank of a pipeline)."""
        self.runner.trim(caches, caches[0].offset - n)

    def generate(
        self,
        prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop=None,
        speculative: int = 0,
    ) -> str:
        return "".join(
            s.text for s in self.stream_generate(prompt, max_tokens, temperature, top_p, top_k, seed, stop, speculative)
        )

    def generate_batch(
        self,
        prompts,
        max_tokens=256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop=None,
        policy=None,
        progress: bool = False,
        on_done=None,
        kv_bits=(0,),
        micro_batches: int = 0,
    ) -> list[str]:
        """Throughput mode (FlexGen, mlx_flash/offload): every prompt's completion, in prompt order.
        prompts: strings (raw completions) or message lists; max_tokens: one budget or one per
        prompt; sampling as generate() (each sequence samples as it would alone, from `seed`).
        policy: an offload.Policy, or None to choose one by the cost model and LP search (kv_bits: the
        KV widths it may pick); on_done(sequence) as each finishes; micro_batches: across ranks, the
        decode micro-batches in flight (0: chosen). The stats of the run (tokens/s, the policy, its
        predicted and measured time) are in `last_batch`."""
        check_sampling(temperature, top_p, top_k)
        check_seed("seed", seed)
        opts = SamplingOptions.of(temperature, top_p, top_k, seed, stop_strings(stop))
        seqs, self.last_batch = self.runner.run_batch(
            self, prompts, max_tokens, opts, policy, progress, on_done, kv_bits, micro_batches
        )
        return [s.text for s in seqs]

    # ---- stats ----------------------------------------------------------------------------------
    def io_bytes(self) -> int:
        """Bytes read from flash since load (FFN reads and streamed layers)."""
        return self.io_counters()[2]

    def io_counters(self) -> tuple[float, float, int, int]:
        """(seconds blocked on reads, seconds decoding what was read, bytes read, reads) since load."""
        s, ls = self.ffn.stats(), self.layer_slots
        if ls is None:
            return s.io_seconds, s.mem_seconds, s.bytes_read, s.reads
        nbytes, reads = ls.read_counts
        return s.io_seconds + ls.blocked_seconds, s.mem_seconds, s.bytes_read + nbytes, s.reads + reads

    def _step_stats(self, t_start: float, io0) -> TokenStats:
        wall = time.perf_counter() - t_start
        io1 = self.io_counters()
        io, mem = io1[0] - io0[0], io1[1] - io0[1]
        return TokenStats(
            wall_ms=wall * 1e3,
            compute_ms=(wall - io - mem) * 1e3,
            io_ms=io * 1e3,
            mem_ms=mem * 1e3,
            bytes_read=io1[2] - io0[2],
            reads=io1[3] - io0[3],
        )

    def close(self) -> None:
        self.runner.close()  # a pipeline's other ranks leave their serving loops
        self.ffn.close()
        if self.layer_slots is not None:
            self.layer_slots.close()
        if self._tier_reads is not None:
            self._tier_reads.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
