"""mlx_flash/bench/switching_trace.py:kv_budget, the switching benchmark's KV budget: `kv_contexts`
contexts counted at the width their chunks are held in memory, so a compressed budget holds as few
contexts as the trace asks (more contexts than it holds is the point of the benchmark)."""

from types import SimpleNamespace

from mlx_flash.bench.switching_trace import SwitchTrace, kv_budget
from mlx_flash.service.chunk_pool import ChunkShape
from mlx_flash.service.coded_chunks import packed_bytes
from mlx_flash.service.service import FLOAT_SHARE

ARGS = SimpleNamespace(num_hidden_layers=32, num_key_value_heads=32, head_dim=128)  # Llama-2-7B's KV
SHAPE = ChunkShape(32, 32, 128, 16)
TRACE = SwitchTrace(contexts=4, min_tokens=2048, max_tokens=2048, switches=8, turns=2, kv_contexts=2)


def engine(prefill_chunk=128):
    return SimpleNamespace(args=ARGS, config=SimpleNamespace(prefill_chunk=prefill_chunk))


def test_without_compression_the_budget_is_float_chunks_of_kv_contexts():
    # 2 contexts of 2048 tokens: 256 chunks, and one more for the partial chunk
    assert kv_budget(engine(), TRACE, [2048] * 4) == 257 * SHAPE.nbytes


def test_a_compressed_budget_holds_kv_contexts_at_their_width_in_the_arena():
    for scheme, bits in (("static:4", 4), ("static:8", 8), ("tolerance:0.5", 4)):
        budget = kv_budget(engine(), TRACE, [2048] * 4, scheme)
        arena = budget - budget // FLOAT_SHARE  # what the service leaves for codes
        assert arena >= 257 * packed_bytes(SHAPE.array_shape, bits) > arena - 2 * packed_bytes(SHAPE.array_shape, bits)
        # and a quarter of the float budget or less: a float-sized one held all four contexts compressed
        assert budget < kv_budget(engine(), TRACE, [2048] * 4) / 2


def test_the_float_slots_hold_one_prefill_pass():
    small = SwitchTrace(contexts=4, min_tokens=64, max_tokens=64, switches=1, turns=1, kv_contexts=1)
    budget = kv_budget(engine(prefill_chunk=512), small, [64] * 4, "static:4")
    assert budget // FLOAT_SHARE >= (512 // 16 + 2) * SHAPE.nbytes
