"""The concurrency benchmark's prompts (python -m mlx_flash.bench concurrency): the question alone by
default; with --context-chars, each client's own excerpt of the Wikipedia set before the same
question (contexts of a set length that differ between clients, so no prefix is shared)."""

from mlx_flash.bench.commands import concurrency as bench_concurrency
from mlx_flash.calibrate import read_corpus


def test_a_client_gets_its_own_excerpt_of_the_set_length_before_its_question():
    alone = [bench_concurrency.prompt(i) for i in range(20)]
    assert len(set(alone)) == 20 and alone[0] == bench_concurrency.PROMPTS[0]
    text = read_corpus("wikipedia")
    for i in (0, 3, 17):
        p = bench_concurrency.prompt(i, 500)
        assert p.startswith(text[i * 500 : (i + 1) * 500]) and p.endswith(alone[i])
    assert bench_concurrency.prompt(1, 500)[:500] != bench_concurrency.prompt(2, 500)[:500]
