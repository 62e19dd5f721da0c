"""Many sequences through one model: FlexGen's throughput mode (engine.generate_batch and
`python -m mlx_flash.batch`).

Sequences go in blocks of policy.block_size. A block is prefilled layer by layer, every sequence
of it through layer i before layer i + 1 (each prompt in the chunks a single run makes, several
prompts' chunks packed into left-padded passes of the tokens the policy's memory holds; each row's
KV is what it computes alone), then decoded step by step in micro-batches
of policy.gpu_batch rows (batching/batch_cache.py BatchKV: each row keeps its own cache and position),
in the policy's order (batching/schedule.py). A sequence that finishes leaves its micro-batch; the
block ends when all have. The sequences of the block's last policy.kv_on_flash micro-batches keep
their KV in files on flash (offload/kv_spill.py), removed when the block ends.
"""

from __future__ import annotations

import time
from typing import Callable

from ..batching.batch_cache import BlockKV, batch_caches
from ..batching.prompts import BatchStats, prefill_together
from ..batching.schedule import MicroBatch, run_block
from ..batching.sequence import SamplingOptions, Sequence
from ..memory.allocator import return_free_memory
from ..memory.process_plan import ModelShape
from ..sampling import check_sampling
from .kv_spill import SpilledKV, SpillFolder, spilled_rows
from .policy import Policy
from .quantized_kv import make_row_caches
from .sparse_attention import with_top_k


def generate_batch(
    engine,
    work: list[tuple[list[int], int]],
    opts: SamplingOptions,
    policy: Policy,
    pass_tokens: int = 0,
    on_done: Callable[[Sequence], None] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> tuple[list[Sequence], BatchStats]:
    """Every prompt's Sequence (work: encode_all's (ids, token budget) per prompt), in prompt order,
    and the run's stats. pass_tokens: the tokens of a prefill pass the policy's memory holds
    (cost_model.prefill_pass; 0: the longest prompt's chunk). on_done(seq) is called as each sequence
    finishes; on_token(n) after each step with the tokens it made (progress)."""
    check_sampling(opts.temperature, opts.top_p, opts.top_k)
    policy.check(engine.args.num_hidden_layers)
    stats = BatchStats(sequences=len(work), policy=policy.to_dict())
    io0 = engine.io_bytes()
    done: list[Sequence] = []
    eos = set(engine.tokenizer.eos_token_ids)
    for start in range(0, len(work), policy.block_size):
        with SpillFolder(engine.config.cache_dir) if policy.kv_on_flash else _NoSpill() as folder:
            block = [
                Sequence.start(
                    start + k, ids, n, _row_caches(engine, policy, k, folder, len(ids) + n), engine.tokenizer, opts
                )
                for k, (ids, n) in enumerate(work[start : start + policy.block_size])
            ]
            stats.blocks += 1
            stats.prompt_tokens += sum(len(s.ids) for s in block)
            t0 = time.perf_counter()
            prefill_together(
                engine,
                block,
                policy.order,
                opts,
                eos,
                lambda caches: with_top_k(caches, policy.attention_keep),
                # the pass the policy's memory holds (cost_model.memory_bytes): several sequences' chunks,
                # or one prompt's chunk, so shorter prompts share a pass and no pass outgrows the longest's
                pass_tokens=pass_tokens or max(min(len(s.ids), engine.config.prefill_chunk) for s in block),
            )
            stats.prefill_s += time.perf_counter() - t0
            return_free_memory()  # the prefill's activations, freed, leave the process (memory/allocator.py)
            made = sum(len(s.tokens) for s in block)
            if on_token:
                on_token(made)
            t0 = time.perf_counter()
            _finish(block, on_done)
            groups = []
            for on_flash in (False, True):
                live = [s for k, s in enumerate(block) if not s.done and policy.on_flash(k) is on_flash]
                groups += [
                    _Group(engine, live[i : i + policy.gpu_batch], policy.kv_bits, on_flash)
                    for i in range(0, len(live), policy.gpu_batch)
                ]
            while groups:
                made = sum(len(g.seqs) for g in groups)
                batches = [
                    MicroBatch(
                        engine.ops.tokens([[s.tokens[-1]] for s in g.seqs]), with_top_k(g.caches, policy.attention_keep)
                    )
                    for g in groups
                ]
                for g, logits in zip(groups, run_block(engine, batches, policy.order)):
                    for b, s in enumerate(g.seqs):
                        s.take(logits[b, -1], opts, eos)
                    g.drop_finished(engine.ops)
                groups = [g for g in groups if g.seqs]
                _finish(block, on_done)
                if on_token:
                    on_token(made)
            stats.decode_s += time.perf_counter() - t0
            for s in block:
                s.caches = None  # the block's KV is freed before the next block's
            return_free_memory()  # and leaves the process, so the next block's reuses none of its holes
            stats.generated_tokens += sum(s.generated for s in block)
            done.extend(block)
    stats.bytes_read = engine.io_bytes() - io0
    return done, stats


class _NoSpill:
    """The spill folder of a policy that keeps all KV in memory: none."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _row_caches(engine, policy: Policy, k: int, folder: SpillFolder | None, tokens: int) -> list:
    """Sequence k of a block's per-layer caches: in memory (exact or 4-bit), or in a file on flash."""
    if not policy.on_flash(k):
        return make_row_caches(engine, policy.kv_bits, tokens)
    shape = ModelShape.from_config(engine.store.config)
    f = folder.file(shape.layers, shape.kv_heads, shape.head_dim, tokens)
    return [SpilledKV(folder, [f], i, [0]) for i in range(shape.layers)]


class _Group:
    """A micro-batch: its sequences and one batch cache per layer, exact rows in one buffer
    (BlockKV), 4-bit rows each in its own cache (BatchKV over QuantizedKV), rows on flash in their
    files (SpilledKV)."""

    def __init__(self, engine, seqs: list[Sequence], kv_bits: int, on_flash: bool = False):
        self.seqs = seqs
        if on_flash:
            self.caches = [spilled_rows([s.caches[i] for s in seqs]) for i in range(len(seqs[0].caches))]
            for s in seqs:
                s.caches = None
        elif kv_bits:
            self.caches = batch_caches([s.caches for s in seqs])
        else:
            cap = max(len(s.ids) + s.max_tokens for s in seqs)
            self.caches = []
            for i in range(len(seqs[0].caches)):  # layer by layer, each sequence's rows freed once copied
                self.caches.append(BlockKV(engine.ops, [s.caches[i] for s in seqs], cap))
                for s in seqs:
                    s.caches[i] = None
            for s in seqs:
                s.caches = None  # their rows are in the block's buffers now

    def drop_finished(self, ops) -> None:
        keep = [b for b, s in enumerate(self.seqs) if not s.done]
        if len(keep) < len(self.seqs):
            self.seqs = [self.seqs[b] for b in keep]
            if keep:
                for c in self.caches:
                    c.keep(ops, keep)


def _finish(block: list[Sequence], on_done) -> None:
    for s in block:
        if s.done and not s.reported:
            s.reported = True
            if on_done:
                on_done(s)
