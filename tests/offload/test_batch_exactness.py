"""Throughput mode is exact: with approximations off (exact KV, float32 on torch), every sequence of a
batch of mixed-length real-text prompts (Wikipedia slices of 5..120 words, fixed seed) generates the
greedy tokens and text it generates alone (`engine.stream_generate`), under each schedule: one
micro-batch of every row, four micro-batches in the zig-zag order and in the row order, and
micro-batches of one row. And `engine.generate_batch` returns generate()'s texts in prompt order
(raw prompts, a chat message list, a stop string, per-prompt budgets, seeded sampling).

Sizes: 8 prompts x 16 tokens on both backends by default (the schedules scaled to 8 rows: one
micro-batch of 8, four of 2, four of 2 in the row order, eight of 1; torch runs the first and the
row order, MLX the four micro-batches in the zig-zag order); the full tier (MLX_FLASH_FULL=1) runs
both backends at 32 x 64 and every schedule.

Engines load with threads=1: the quantized-matmul kernel splits output columns between threads (so
the thread count changes no result), and its workers busy-wait for the next product, which on a
CPU shared with other processes makes two threads ~10x slower than one (measured on a 2-core box
under load: 43 s against 3.8 s for the same 64 tokens).
"""

import os
from dataclasses import replace

import numpy as np
import pytest

import mlx_flash
from mlx_flash.offload import Order, Policy
from mlx_flash.batching.prompts import ragged_rows
from mlx_flash.offload.cost_model import PACKED_PASS
from mlx_flash.batching.sequence import SamplingOptions
from mlx_flash.offload.run import run_batch

pytestmark = pytest.mark.slow
THREADS = 1  # see the module docstring

FULL = os.environ.get("MLX_FLASH_FULL") == "1"
SIZES = {"torch": (32, 64) if FULL else (8, 16), "mlx": (32, 64) if FULL else (8, 16)}  # (prompts, tokens)
SCHEDULES = {  # name -> policy for n prompts (at n = 16: (16,1), (4,4), (4,4) row, (1,16))
    "one-micro-batch": lambda n: Policy(n, 1),
    "four-micro-batches": lambda n: Policy(n // 4, 4),
    "four-micro-batches-row-order": lambda n: Policy(n // 4, 4, order=Order.ROW),
    "one-row-micro-batches": lambda n: Policy(1, n),
}
# the default tier's schedules per backend (the full tier runs all four on both): the schedules share
# one code path, whose zig-zag order MLX covers here and whose row order torch does
DEFAULT_SCHEDULES = {"torch": ("one-micro-batch", "four-micro-batches-row-order"), "mlx": ("four-micro-batches",)}


def wiki_prompts(text: str, n: int, seed: int = 0, lo: int = 5, hi: int = 120) -> list[str]:
    """n slices of lo..hi consecutive words at random places of the text."""
    words = text.split()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(lo, hi + 1))
        s = int(rng.integers(0, len(words) - k))
        out.append(" ".join(words[s : s + k]))
    return out


def alone(engine, prompt, max_tokens, **kw):
    """(tokens, text, finish_reason) of one sequence run alone."""
    steps = list(engine.stream_generate(prompt, max_tokens=max_tokens, **kw))
    return list(engine.last.tokens), "".join(s.text for s in steps), steps[-1].finish_reason


@pytest.fixture(scope="module", params=["torch", "mlx"])
def case(request, default_gguf, wiki_text):
    """(engine, prompts, tokens per sequence, each prompt's run alone) per backend."""
    backend = request.param
    n, max_tokens = SIZES[backend]
    engine = mlx_flash.load(backend=backend, threads=THREADS, progress=False)
    prompts = wiki_prompts(wiki_text, n)
    lengths = [len(engine.tokenizer.encode(p)) for p in prompts]
    assert min(lengths) < 32 and max(lengths) > 100  # mixed lengths, as the test means them
    refs = [alone(engine, p, max_tokens) for p in prompts]
    yield engine, prompts, max_tokens, refs
    engine.close()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_sequence_equals_its_run_alone(case, schedule):
    engine, prompts, max_tokens, refs = case
    if not FULL and schedule not in DEFAULT_SCHEDULES[engine.ops.name]:
        pytest.skip(f"{engine.ops.name} runs {', '.join(DEFAULT_SCHEDULES[engine.ops.name])} unless MLX_FLASH_FULL=1")
    policy = SCHEDULES[schedule](len(prompts))
    seqs, stats = run_batch(engine, prompts, max_tokens, SamplingOptions(), policy, False)
    assert sorted(s.index for s in seqs) == list(range(len(prompts)))
    by_index = {s.index: s for s in seqs}
    wrong = [k for k, (tokens, _, _) in enumerate(refs) if by_index[k].tokens != tokens]
    assert not wrong, f"{engine.ops.name} {policy}: sequences {wrong} differ from their runs alone"
    for k, (tokens, text, finish) in enumerate(refs):
        s = by_index[k]
        assert s.text == text and s.finish_reason == finish, k
    assert stats.sequences == len(prompts)
    assert stats.generated_tokens == sum(s.generated for s in seqs)
    assert stats.blocks == -(-len(prompts) // policy.block_size)
    assert stats.policy == policy.to_dict()  # the model is resident: the given policy runs as given
    assert stats.tokens_per_s > 0


def test_sequences_leaving_their_micro_batch_part_way_are_exact(case):
    """Budgets of 1..14 tokens per prompt: sequences finish at different steps (one right after its
    prefill) and leave their micro-batch, whose buffer is compacted; the rest go on exactly."""
    engine, prompts, _, _ = case
    if engine.ops.name == "mlx" and not FULL:
        pytest.skip("checked on torch unless MLX_FLASH_FULL=1 (the same code path on every backend)")
    batch = prompts[:12]
    budgets = [int(n) for n in np.random.default_rng(3).integers(1, 15, size=len(batch))]
    budgets[5] = 1
    refs = [alone(engine, p, n)[0] for p, n in zip(batch, budgets)]
    # the default tier: one schedule (the row order and uneven micro-batches in the full tier)
    for policy in (Policy(4, 3), Policy(4, 3, order=Order.ROW), Policy(3, 2))[: None if FULL else 1]:
        seqs, stats = run_batch(engine, batch, budgets, SamplingOptions(), policy, False)
        got = [s.tokens for s in sorted(seqs, key=lambda s: s.index)]
        assert got == refs, policy
        assert [len(t) for t in got] == budgets or any(t[-1] in engine.tokenizer.eos_token_ids for t in got)
        assert stats.blocks == -(-len(batch) // policy.block_size)


def test_generate_batch_texts_equal_generate(case):
    engine, prompts, _, _ = case
    if engine.ops.name != "torch":
        pytest.skip("the texts are checked on torch (the same code path on every backend)")
    chat = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three rivers of Europe."},
    ]
    batch = [prompts[0], chat, prompts[1], prompts[2]]
    budgets = [24, 20, 12, 16]
    # a stop string inside prompt 2's greedy output, so that it ends that sequence part way
    full = engine.generate(batch[2], max_tokens=12)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and full.find(stop) < len(full) - len(stop)
    want = [engine.generate(p, max_tokens=n, stop=[stop, "@@never@@"]) for p, n in zip(batch, budgets)]
    assert len(want[2]) < len(full)  # the stop string did cut it
    got = engine.generate_batch(batch, max_tokens=budgets, stop=[stop, "@@never@@"])
    assert got == want
    st = engine.last_batch
    assert st.sequences == 4 and st.generated_tokens > 0 and st.tokens_per_s > 0
    assert st.predicted_s > 0 and st.policy  # the policy the search chose, and its prediction
    # one budget for all, no stop string
    assert engine.generate_batch(batch[:2], max_tokens=10) == [engine.generate(p, max_tokens=10) for p in batch[:2]]


def test_seeded_sampling_equals_the_single_run_with_that_seed(case):
    engine, prompts, _, _ = case
    if engine.ops.name != "torch":
        pytest.skip("sampling is checked on torch (the same code path on every backend)")
    batch = prompts[3:7]
    kw = dict(temperature=0.9, top_p=0.95, top_k=50)
    for seed in (7,):
        want = [engine.generate(p, max_tokens=16, seed=seed, **kw) for p in batch]
        got = engine.generate_batch(batch, max_tokens=16, seed=seed, policy=Policy(2, 2), **kw)
        assert got == want, seed
    greedy = engine.generate_batch(batch, max_tokens=16, policy=Policy(2, 2))
    assert got != greedy  # sampling did sample
    assert got != engine.generate_batch(batch, max_tokens=16, seed=9, policy=Policy(4, 1), **kw)


@pytest.fixture(scope="module")
def chunked(default_gguf):
    with mlx_flash.load(backend="torch", threads=THREADS, progress=False, prefill_chunk=32) as e:
        yield e


def test_prompts_prefilled_in_chunks_equal_their_runs_alone(chunked, wiki_text):
    """Prompts longer than prefill_chunk are prefilled chunk by chunk, each round through the block."""
    prompts = wiki_prompts(wiki_text, 4, seed=1, lo=15, hi=60)
    lengths = sorted(len(chunked.tokenizer.encode(p)) for p in prompts)
    assert lengths[0] < 32 < lengths[-2] and lengths[-1] > 2 * 32  # one, two and three chunks
    refs = [alone(chunked, p, 6)[0] for p in prompts]
    for policy in (Policy(2, 2), Policy(2, 2, order=Order.ROW)):
        seqs, stats = run_batch(chunked, prompts, 6, SamplingOptions(), policy, False)
        assert [s.tokens for s in sorted(seqs, key=lambda s: s.index)] == refs, policy
        assert stats.prefill_pass == PACKED_PASS  # several prompts' 32-token chunks in one pass


@pytest.fixture(scope="module")
def streamed(default_gguf, wiki_text):
    """An engine reading every FFN layer from the store (ffn="stream"), 6 prompts and their runs alone."""
    with mlx_flash.load(backend="torch", ffn="stream", threads=THREADS, progress=False) as e:
        prompts = wiki_prompts(wiki_text, 6, seed=2, hi=60)
        yield e, prompts, [alone(e, p, 8)[0] for p in prompts]


def layer_calls(seqs, policy: Policy, chunk: int, pass_tokens: int) -> int:
    """How often a block schedule asks for each streamed layer: once per block pass (prefill round or
    decode step) in the zig-zag order, once per micro-batch in the row order. Prompts here are one
    prefill chunk, packed into left-padded passes of at most `pass_tokens` (the run's packed pass,
    cost_model.prefill_pass) or else the longest prompt's tokens; after the prefill, the
    sequences still running form micro-batches of gpu_batch that keep their members, and a
    micro-batch runs a step while one of them has tokens to make."""
    calls = 0
    ordered = sorted(seqs, key=lambda s: s.index)
    row = policy.order is Order.ROW
    for b in range(0, len(ordered), policy.block_size):
        block = [len(s.tokens) for s in ordered[b : b + policy.block_size]]
        widths = [min(len(s.ids), chunk) for s in ordered[b : b + policy.block_size]]
        passes = ragged_rows(widths, pass_tokens or max(widths))
        calls += len(passes) if row else 1  # prefill: one per packed pass (row) or one for the block
        live = [n for n in block if n > 1]
        groups = [live[i : i + policy.gpu_batch] for i in range(0, len(live), policy.gpu_batch)]
        for step in range(1, max(block)):
            running = sum(max(g) > step for g in groups)
            calls += running if row else min(running, 1)
    return calls


@pytest.mark.parametrize(
    "policy",
    [  # the full tier adds three (~13 s) whose features the default three cover: layers held
        # (resident_layers 4), no overlap (the row order's), the zig-zag order (kv_on_flash 1)
        pytest.param(Policy(3, 2, resident_layers=10), marks=pytest.mark.full),
        pytest.param(Policy(6, 1, resident_layers=30), marks=pytest.mark.full),
        Policy(2, 3, order=Order.ROW, overlap=False),
        pytest.param(Policy(2, 2, resident_layers=5, overlap=False), marks=pytest.mark.full),
        Policy(3, 2, resident_layers=4, kv_on_flash=1),
        Policy(2, 3, order=Order.ROW, kv_on_flash=3),
    ],
    ids=str,
)
def test_placed_layers_read_from_flash_are_exact(streamed, policy):
    """ffn="stream": the policy holds its first layers and reads the others from the store, once per
    layer and block pass (zig-zag) or once per micro-batch (row), and keeps the KV of its last
    kv_on_flash micro-batches in files on flash: the tokens do not change, the bytes read are what
    the order says, and the spill files are gone after the run."""
    e, prompts, refs = streamed
    spills = lambda: {n for n in os.listdir(e.config.cache_dir) if n.startswith("kv-spill-")}  # noqa: E731
    before = spills()  # (a process killed mid-run elsewhere may have left one in a shared cache)
    seqs, stats = run_batch(e, prompts, 8, SamplingOptions(), policy, False)
    assert [s.tokens for s in sorted(seqs, key=lambda s: s.index)] == refs
    assert stats.policy == policy.to_dict()
    layer = e.store.manifest.ffn.layer_nbytes
    want = (
        layer_calls(seqs, policy, e.config.prefill_chunk, stats.prefill_pass)
        * (e.args.num_hidden_layers - policy.resident_layers)
        * layer
    )
    # (a read started ahead at the end of one run may be the next run's first)
    assert abs(stats.bytes_read - want) <= layer, (stats.bytes_read / layer, want / layer)
    assert not e.ffn.held  # the placement is undone after the run
    assert not spills() - before  # this run's spill files are gone


def test_the_streamed_engine_runs_alone_exactly_after_a_batch(streamed):
    e, prompts, refs = streamed
    run_batch(e, prompts[:2], 8, SamplingOptions(), Policy(2, 1, resident_layers=12), False)
    assert alone(e, prompts[1], 8)[0] == refs[1]


@pytest.mark.full  # ~16 s; top-k attention over each cache kind at small sizes: tests/offload/test_sparse_attention.py
def test_sparse_attention_runs_over_every_kind_of_block_cache(streamed):
    """attention_keep wraps a block's caches in memory, on flash and at 4 bits: a share that keeps
    every key leaves the greedy tokens as they were; a small one runs, and changes them."""
    e, prompts, refs = streamed
    for base in (Policy(3, 2), Policy(3, 2, kv_on_flash=1), Policy(2, 3, kv_bits=4)):
        seqs, _ = run_batch(e, prompts, 8, SamplingOptions(), replace(base, attention_keep=0.999999), False)
        got = [s.tokens for s in sorted(seqs, key=lambda s: s.index)]
        if not base.kv_bits:
            assert got == refs, base
        seqs, _ = run_batch(e, prompts, 8, SamplingOptions(), replace(base, attention_keep=0.05), False)
        sparse = [s.tokens for s in sorted(seqs, key=lambda s: s.index)]
        assert all(len(t) == len(r) or t[-1] in e.tokenizer.eos_token_ids for t, r in zip(sparse, refs))
        assert sparse != refs, base
