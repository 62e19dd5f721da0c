"""Bringing a context's swapped chunks back: read from flash and recomputed from their tokens at
once (LLMS §3.3), split so the two finish together.

A chunk can be recomputed when every chunk before it is in memory: running the model over its
tokens with the cache positioned at its first token writes exactly its KV (the causal mask and
RoPE positions are those of the original pass). So the leading k missing chunks are recomputed,
in order, while the reader pool loads the rest; k balances k chunks of recompute against m - k
chunks of reading, by the costs measured on earlier restores (LoadCosts). A chunk whose swap file
is missing or fails its checksum is recomputed too, after the chunks before it are in, and is
never used.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, field

import numpy as np

from .swap_files import HEADER, chunk_data, file_bytes, payload_bytes

PLACE_CHUNKS = 8  # chunks decoded, then placed in the pool, at a time (a 7B chunk is 16 MB of float32)


@dataclass
class LoadCosts:
    """Seconds per token of recompute and per byte of swap-in (read, checked and placed), as
    measured: every prefill the service runs updates the first, every restore both (moving
    averages). Recompute's cost is unknown until a prefill was measured, and then nothing is
    recomputed: a guess is off by 100x between a 135M and a 7B model (a 7B-shape model prefills a
    few tokens a second on two cores), while reading is always possible."""

    recompute_s_per_token: float | None = None
    read_s_per_byte: float = 1e-9  # 1 GB/s until measured
    pass_s: float = 0.0  # what any forward pass costs whatever its length (one decode step, measured)

    def update(self, recompute_s: float, tokens: int, read_s: float, nbytes: int, step_s: float = 0.0) -> None:
        if tokens:
            now = recompute_s / tokens
            old = self.recompute_s_per_token
            self.recompute_s_per_token = now if old is None else 0.5 * old + 0.5 * now
        if nbytes:
            self.read_s_per_byte = 0.5 * self.read_s_per_byte + 0.5 * read_s / nbytes
        if step_s:
            self.pass_s = 0.5 * self.pass_s + 0.5 * step_s if self.pass_s else step_s

    def recompute_count(self, missing: int, chunk_tokens: int, chunk_bytes: int) -> int:
        """How many of `missing` chunks to recompute so reading the rest takes as long (a linear
        cost per side, as the paper fits; recomputing anything costs a pass first)."""
        if self.recompute_s_per_token is None:
            return 0
        rc, io = chunk_tokens * self.recompute_s_per_token, chunk_bytes * self.read_s_per_byte
        return min(range(missing + 1), key=lambda k: max(k * rc + (self.pass_s if k else 0.0), (missing - k) * io))


@dataclass
class RestoreReport:
    chunks_read: int = 0
    chunks_recomputed: int = 0
    bad_files: list[str] = field(default_factory=list)  # chunks whose swap file could not be used
    seconds: float = 0.0


def restore(
    engine,
    pool,
    swap,
    reader,
    ctx,
    n_tokens: int,
    costs: LoadCosts,
    claim,
    recompute_only: bool = False,
    read_only: bool = False,
    place=None,
) -> RestoreReport:
    """Bring the chunks holding ctx's first n_tokens tokens into memory (float slots from `claim`;
    a compressed chunk's bytes straight into the pool's arena by `place(payload, bits)` -> its slot,
    or None where the arena has no room: then decoded into a float slot). recompute_only /
    read_only force one technique (the benchmark's ablations)."""
    t0 = time.perf_counter()
    report = RestoreReport()
    table, shape, C = ctx.table, pool.shape, pool.shape.tokens
    missing = [i for i in range(table.chunks_for(n_tokens)) if table.slots[i] is None]
    if not missing:
        return report
    mean_bytes = sum(payload_bytes(shape, ctx.widths[i]) for i in missing) / len(missing)
    k = len(missing) if recompute_only else 0 if read_only else costs.recompute_count(len(missing), C, mean_bytes)
    coded = set() if place is None else {i for i in missing[k:] if ctx.disk[i] is not None and ctx.widths[i]}
    try:
        for i in missing:
            if i not in coded:  # (a compressed chunk read gets its slot where it is placed)
                table.slots[i] = claim()
        _bring_back(engine, pool, swap, reader, ctx, n_tokens, costs, missing, k, report, coded, claim, place)
    except BaseException:
        for i in missing:  # nothing half-restored stays: the chunks are still on flash or recomputable
            if table.slots[i] is not None:
                pool.release(table.slots[i])
                table.slots[i] = None
        raise
    report.seconds = time.perf_counter() - t0
    return report


def _bring_back(engine, pool, swap, reader, ctx, n_tokens, costs, missing, k, report, coded, claim, place) -> None:
    table, shape, C = ctx.table, pool.shape, pool.shape.tokens
    to_read = [i for i in missing[k:] if ctx.disk[i] is not None]
    # Start the reads, then recompute the leading chunks while they run.
    row = file_bytes(shape, 0)  # the widest file; page-aligned rows, so whole-block reads land in place
    mem = mmap.mmap(-1, max(1, len(to_read) * row))
    buf = np.frombuffer(mem, np.uint8)[: len(to_read) * row].reshape(len(to_read), row)
    files, ranges, t_read = {}, [], time.perf_counter()
    for j, i in enumerate(to_read):
        try:
            f = reader.open(swap.chunk_path(ctx.id, i))
        except OSError:
            continue  # no file: recomputed once the reads are in
        files[j] = f
        ranges.append((f, 0, min(f.size, file_bytes(shape, ctx.widths[i])), buf[j]))
    batch = reader.submit(ranges, priority=0) if ranges else None
    pending = set(to_read)
    recompute = [i for i in missing if i not in pending]
    rc_tokens, rc_s = 0, 0.0

    def settle():
        """Wait for the reads, check and place each chunk; a bad one joins the recompute list."""
        read_error = None
        if batch is not None:
            try:
                batch.wait()
            except Exception as e:  # a short read (truncated file) or an I/O error: recompute them
                read_error = f"{ctx.id}: reading swapped chunks failed ({e})"
        # decoded in place, PLACE_CHUNKS at a time: the float32 staging stays small beside the budget
        data = np.empty((min(len(to_read), PLACE_CHUNKS),) + shape.array_shape, np.float32)
        staged: list[int] = []  # the slots of the chunks decoded into data[: len(staged)]
        read = 0

        def to_pool() -> None:
            if staged:
                pool.load(staged, data[: len(staged)])
                staged.clear()

        for j, i in enumerate(to_read):
            path = swap.chunk_path(ctx.id, i)
            if j not in files:
                problem = f"{path}: missing"
            elif files[j].size < HEADER + payload_bytes(shape, ctx.widths[i]):
                problem = f"{path}: truncated ({files[j].size} bytes)"
            elif read_error:
                problem = read_error
            else:
                problem = swap.chunk_problem(
                    path,
                    bytes(buf[j, :HEADER]),
                    buf[j, HEADER:],
                    shape,
                    ctx.chunk_tokens(i),
                    ctx.widths[i],
                    ctx.disk[i],
                )
            if problem is not None:
                report.bad_files.append(problem)
                ctx.disk[i] = None
                if table.slots[i] is None:
                    table.slots[i] = claim()
                recompute.append(i)
                continue
            read += 1
            if i in coded:  # its bytes are what the arena holds
                table.slots[i] = place(buf[j, HEADER:], ctx.widths[i])
                if table.slots[i] is not None:
                    continue
                table.slots[i] = claim()
            chunk_data(buf[j, HEADER:], shape, ctx.widths[i], out=data[len(staged)])
            staged.append(table.slots[i])
            if len(staged) == len(data):
                to_pool()
        to_pool()
        report.chunks_read = read
        # a read's cost includes checking and placing it: that part runs on this thread, not beside it
        read_s = time.perf_counter() - t_read
        costs.update(0.0, 0, read_s, sum(payload_bytes(shape, ctx.widths[i]) for i in to_read))
        for f in files.values():
            reader.close_file(f)
        pending.clear()

    while recompute or pending:
        if not recompute:
            settle()
            continue
        recompute.sort()
        i = recompute[0]
        if any(p < i for p in pending):  # its predecessors are still being read
            settle()
            continue
        j = i  # a run of consecutive chunks recomputed in one pass
        while j + 1 in recompute:
            j += 1
        start, end = i * C, min((j + 1) * C, n_tokens)
        t = time.perf_counter()
        engine.prefill(ctx.sequence[start:end], table.caches(start))
        rc_s += time.perf_counter() - t
        rc_tokens += end - start
        report.chunks_recomputed += j - i + 1
        del recompute[: j - i + 1]
    costs.update(rc_s, rc_tokens, 0.0, 0)
