"""How a restore splits its missing chunks between reading and recomputing (service/restore.py
LoadCosts): nothing is recomputed before a prefill was measured; then the split follows the costs."""

from mlx_flash.service.restore import LoadCosts

CHUNK_TOKENS, CHUNK_BYTES = 16, 2_500_000  # a 4-bit chunk of a 7B-shape model


def test_nothing_is_recomputed_on_an_unmeasured_cost():
    assert LoadCosts().recompute_count(128, CHUNK_TOKENS, CHUNK_BYTES) == 0


def test_a_slow_prefill_reads_everything_and_a_fast_one_recomputes_some():
    slow = LoadCosts()
    slow.update(recompute_s=10.0, tokens=32, read_s=0.085 * 8, nbytes=8 * CHUNK_BYTES)  # 3 tokens/s, 85 ms a chunk
    assert slow.recompute_count(16, CHUNK_TOKENS, CHUNK_BYTES) == 0  # one chunk's recompute outlasts 16 reads
    fast = LoadCosts()
    fast.update(recompute_s=0.016, tokens=32, read_s=0.085 * 8, nbytes=8 * CHUNK_BYTES)  # 2,000 tokens/s
    k = fast.recompute_count(128, CHUNK_TOKENS, CHUNK_BYTES)
    assert 0 < k < 128
    # the split balances the two sides: k chunks recomputed take about as long as the rest read
    rc, io = CHUNK_TOKENS * fast.recompute_s_per_token, CHUNK_BYTES * fast.read_s_per_byte
    assert abs(k * rc - (128 - k) * io) <= max(rc, io)
