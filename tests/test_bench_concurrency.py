"""tools/bench_concurrency.py's prompts: the question alone by default; with --context-chars, each
client's own excerpt of the Wikipedia set before the same question (contexts of a set length that
differ between clients, so no prefix is shared)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_concurrency  # noqa: E402

from mlx_flash.calibrate import read_corpus  # noqa: E402


def test_a_client_gets_its_own_excerpt_of_the_set_length_before_its_question():
    alone = [bench_concurrency.prompt(i) for i in range(20)]
    assert len(set(alone)) == 20 and alone[0] == bench_concurrency.PROMPTS[0]
    text = read_corpus("wikipedia")
    for i in (0, 3, 17):
        p = bench_concurrency.prompt(i, 500)
        assert p.startswith(text[i * 500 : (i + 1) * 500]) and p.endswith(alone[i])
    assert bench_concurrency.prompt(1, 500)[:500] != bench_concurrency.prompt(2, 500)[:500]
