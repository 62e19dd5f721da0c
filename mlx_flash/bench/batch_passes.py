"""What a batched pass costs on the loaded engine, the numbers behind the throughput mode's cap
(docs/earlier-results/throughput.md): a decode step of B rows (each holding `held` tokens in one BlockKV,
or, as the server holds them, in a chunk pool) and a prefill pass of R prompts of T tokens packed
left-padded into one pass, each the median wall time of `repeat` calls after one warm-up, with
tokens/s and GFLOP/s (2 x the engine's parameters in products a token, attention not counted).
`products_pass` times the weight products alone for B rows of one token (every layer's attention
projections and FFN, no attention, no head): the rate the batched products allow, which the
server's aggregate rate is held against; `head_pass` the output head's product for B rows, which a
decode step computes too; `attention_pass` every layer's attention of the server's decode step
alone (rows of `held` tokens in a chunk pool, read where they lie)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..batching.batch_cache import BlockKV, batch_caches
from ..batching.schedule import MicroBatch, Order, run_block
from ..models.cache import make_caches
from ..service.chunk_pool import ChunkPool, ChunkShape
from ..service.chunked_kv import ChunkTable, chunked_batch_caches
from .timing import median_seconds


@dataclass
class PassTime:
    kind: str  # "decode" or "prefill"
    rows: int
    tokens: int  # tokens a row adds in the pass
    seconds: float
    product_flops: float  # of the pass: 2 x product parameters x tokens

    @property
    def tokens_per_s(self) -> float:
        return self.rows * self.tokens / self.seconds

    @property
    def gflops(self) -> float:
        return self.product_flops / self.seconds / 1e9

    def line(self) -> str:
        what = {
            "decode": f"decode step of {self.rows} rows",
            "chunked": f"chunk-pool step, {self.rows} rows",
            "products": f"products of {self.rows} rows",
            "head": f"head of {self.rows} rows",
            "attention": f"attention of {self.rows} rows",
        }.get(self.kind, f"prefill {self.rows} x {self.tokens}")
        return f"{what:28s} {self.seconds * 1e3:8.1f} ms  {self.tokens_per_s:8.0f} tok/s  {self.gflops:6.0f} GFLOP/s"


def product_parameters(engine) -> int:
    """Weights a token multiplies in the layers' products (attention and FFN; not the embeddings)."""
    a = engine.args
    hd = a.head_dim
    attn = a.hidden_size * hd * (2 * a.num_attention_heads + 2 * a.num_key_value_heads)
    return a.num_hidden_layers * (attn + 3 * a.hidden_size * a.intermediate_size)


def decode_step(engine, rows: int, held: int = 128, repeat: int = 5, seed: int = 0) -> PassTime:
    rng = np.random.default_rng(seed)
    L, vocab = engine.args.num_hidden_layers, engine.args.vocab_size
    seqs = [make_caches(L, held + repeat + 2) for _ in range(rows)]
    for caches in seqs:
        engine.forward(rng.integers(0, vocab, size=held).tolist(), caches)
    block = [BlockKV(engine.ops, [c[i] for c in seqs], held + repeat + 2) for i in range(L)]
    tokens = engine.ops.tokens(rng.integers(0, vocab, size=(rows, 1)).tolist())
    s = median_seconds(lambda: run_block(engine, [MicroBatch(tokens, block)], Order.ZIGZAG), repeat)
    return PassTime("decode", rows, 1, s, 2.0 * product_parameters(engine) * rows)


def chunked_decode_step(
    engine, rows: int, held: int = 128, chunk_tokens: int = 32, repeat: int = 5, seed: int = 0
) -> PassTime:
    """The server's decode step (service/running_batch.py): `rows` contexts of `held` tokens each in
    one chunk pool, their chunks interleaved as contexts prefilled side by side leave them, one token
    each through ChunkedBatchKV (attention over every row's chunks where they lie)."""
    rng = np.random.default_rng(seed)
    a, vocab = engine.args, engine.args.vocab_size
    per_row = -(-(held + 1) // chunk_tokens)
    pool = ChunkPool(engine.ops, ChunkShape(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, chunk_tokens),
                     rows * per_row)  # fmt: skip
    tables = [ChunkTable(pool) for _ in range(rows)]
    for start in range(0, held, chunk_tokens):  # one chunk of every row in turn
        for t in tables:
            caches = t.caches()
            engine.forward(rng.integers(0, vocab, size=min(chunk_tokens, held - start)).tolist(), caches)
            t.tokens = caches[0].offset
    caches = [t.caches() for t in tables]
    tokens = engine.ops.tokens(rng.integers(0, vocab, size=(rows, 1)).tolist())

    def one():
        run_block(engine, [MicroBatch(tokens, chunked_batch_caches(caches))], Order.ZIGZAG)
        for per_layer in caches:  # the next call writes the same position again
            for c in per_layer:
                c.trim(1)

    s = median_seconds(one, repeat)
    return PassTime("chunked", rows, 1, s, 2.0 * product_parameters(engine) * rows)


def prefill_pass(engine, rows: int, tokens: int, repeat: int = 3, seed: int = 0) -> PassTime:
    rng = np.random.default_rng(seed)
    L, vocab = engine.args.num_hidden_layers, engine.args.vocab_size
    ids = engine.ops.tokens(rng.integers(0, vocab, size=(rows, tokens)).tolist())

    def one():
        caches = batch_caches([make_caches(L, tokens) for _ in range(rows)], [tokens] * rows)
        run_block(engine, [MicroBatch(ids, caches)], Order.ZIGZAG)

    s = median_seconds(one, repeat)
    return PassTime("prefill", rows, tokens, s, 2.0 * product_parameters(engine) * rows * tokens)


def products_pass(engine, rows: int, repeat: int = 5, seed: int = 0) -> PassTime:
    """The layers' weight products for `rows` rows of one token, as a decode step computes them
    (Llama-family graphs: fused qkv, o, the gated FFN), nothing else."""
    ops, args, layers = engine.ops, engine.args, engine.weights["layers"]
    if "qkv" not in layers[0]:
        raise ValueError("products_pass times Llama-family layers (a fused qkv projection)")
    rng = np.random.default_rng(seed)
    D, attn = args.hidden_size, args.num_attention_heads * args.head_dim
    x = ops.array(rng.standard_normal((rows, 1, D)).astype(np.float32) * 0.1)
    a = ops.array(rng.standard_normal((rows, 1, attn)).astype(np.float32) * 0.1)

    def one():
        outs = []
        for i, lw in enumerate(layers):
            outs += [
                ops.linear(x, lw["qkv"]),
                ops.linear(a, lw["o"]),
                engine.module.mlp(ops, args, engine.ffn.layer(i, x), x),
            ]
        ops.materialize(*outs)

    s = median_seconds(one, repeat)
    return PassTime("products", rows, 1, s, 2.0 * product_parameters(engine) * rows)


def head_pass(engine, rows: int, repeat: int = 5, seed: int = 0) -> PassTime:
    """The output head's product for `rows` rows of one token (its FLOPs: 2 x vocab x width a row),
    the product a decode step computes besides the layers' (products_pass)."""
    ops, args = engine.ops, engine.args
    rng = np.random.default_rng(seed)
    h = ops.array(rng.standard_normal((rows, 1, args.hidden_size)).astype(np.float32) * 0.1)
    s = median_seconds(lambda: ops.materialize(engine.module.head(ops, args, engine.weights, h)), repeat)
    return PassTime("head", rows, 1, s, 2.0 * args.vocab_size * args.hidden_size * rows)


def attention_pass(engine, rows: int, held: int = 128, chunk_tokens: int = 32, repeat: int = 10, seed: int = 0):
    """Every layer's attention of a server decode step alone (ops.sdpa_slots): `rows` contexts of
    held + 1 tokens, each layer's chunks in its own pool (as the server's pool holds every layer
    apart) in a random order, one query a row. Its FLOPs (scores and values: 4 x query heads x head
    width a key) stand where a pass's products do."""
    ops, a = engine.ops, engine.args
    rng = np.random.default_rng(seed)
    kv = held + 1
    per_row = -(-kv // chunk_tokens)
    n, H, Hkv, hd = rows * per_row, a.num_attention_heads, a.num_key_value_heads, a.head_dim
    pools = [
        [ops.array(rng.standard_normal((Hkv, n * chunk_tokens, hd)).astype(np.float32)) for _ in range(2)]
        for _ in range(a.num_hidden_layers)
    ]
    q = ops.array(rng.standard_normal((rows, H, 1, hd)).astype(np.float32))
    table = rng.permutation(n).reshape(rows, per_row).astype(np.int32)
    kv_len = np.full(rows, kv, np.int32)
    q_pos = kv_len - 1

    def one():
        outs = [ops.sdpa_slots(q, k, v, hd**-0.5, chunk_tokens, table, kv_len, q_pos) for k, v in pools]
        ops.materialize(*outs)

    s = median_seconds(one, repeat)
    return PassTime("attention", rows, 1, s, 4.0 * H * hd * kv * rows * a.num_hidden_layers)
