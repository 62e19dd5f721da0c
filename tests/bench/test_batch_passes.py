"""`python -m mlx_flash.bench batch-passes` (mlx_flash/bench/batch_passes.py) on a tiny random
llama: each line is measured, its FLOPs are the products' parameters x tokens (attention's: 4 x heads x head width a
key), and bad lists are refused in one line."""

import os
import subprocess
import sys

import mlx_flash
from mlx_flash.bench.batch_passes import (
    attention_pass,
    chunked_decode_step,
    decode_step,
    head_pass,
    prefill_pass,
    product_parameters,
    products_pass,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = [sys.executable, "-m", "mlx_flash.bench", "batch-passes"]


def test_passes_are_timed_and_counted(tiny_store):
    store, _ = tiny_store("llama")
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False) as e:
        a = e.args
        per_layer = a.hidden_size * a.head_dim * (2 * a.num_attention_heads + 2 * a.num_key_value_heads)
        assert product_parameters(e) == a.num_hidden_layers * (per_layer + 3 * a.hidden_size * a.intermediate_size)
        d = decode_step(e, 3, held=8, repeat=1)
        p = prefill_pass(e, 2, 5, repeat=1)
        pp = products_pass(e, 4, repeat=1)
        c = chunked_decode_step(e, 3, held=20, chunk_tokens=8, repeat=1)
        h = head_pass(e, 4, repeat=1)
        at = attention_pass(e, 3, held=20, chunk_tokens=8, repeat=1)
    assert c.seconds > 0 and c.product_flops == d.product_flops and "chunk-pool step, 3 rows" in c.line()
    att_flops = 4.0 * a.num_attention_heads * a.head_dim * 21 * 3 * a.num_hidden_layers
    assert at.seconds > 0 and at.product_flops == att_flops and "attention of 3 rows" in at.line()
    assert h.seconds > 0 and h.product_flops == 2.0 * a.vocab_size * a.hidden_size * 4 and "head of 4" in h.line()
    assert d.seconds > 0 and d.tokens_per_s == 3 / d.seconds and d.product_flops == 2.0 * product_parameters(e) * 3
    assert p.product_flops == 2.0 * product_parameters(e) * 10 and "prefill 2 x 5" in p.line()
    assert pp.seconds > 0 and pp.product_flops == 2.0 * product_parameters(e) * 4 and "products of 4 rows" in pp.line()


def test_the_tool_prints_a_line_per_pass_and_refuses_bad_lists(tiny_store):
    store, _ = tiny_store("llama")
    r = subprocess.run(
        [
            *BENCH,
            "--model",
            store,
            "--rows",
            "1,2",
            "--prompts",
            "2",
            "--prompt-tokens",
            "6",
            "--chunked-rows",
            "2",
            "--products",
            "3",
            "--attention",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "tok/s" in ln]
    assert len(lines) == 8 and "decode step of 2 rows" in lines[1] and "chunk-pool step, 2 rows" in lines[2]
    assert "prefill 2 x 6" in lines[3] and "products of 3 rows" in lines[4] and "head of 3 rows" in lines[5]
    assert "products with the head" in lines[6] and "attention of 2 rows" in lines[7]
    bad = subprocess.run([*BENCH, "--rows", "1,x"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "not a comma-separated list" in bad.stderr and "Traceback" not in bad.stderr
