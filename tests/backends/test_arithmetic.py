"""The arithmetic choice (backends/arithmetic.py, load(arithmetic=...)): auto is exact, q8 is asked for by
name and refused where the products are not the CPU kernels, the load names it; inside q8 every exact
mode still equals resident bit for bit (the FFN streamed, the sparse FFN with the dense predictor) on
both backends, and q8 is what ran (its logits are not exact's)."""

import numpy as np
import pytest

import mlx_flash
from greedy import greedy
from mlx_flash.backends.arithmetic import choose_arithmetic
from mlx_flash.errors import ConfigError
from mlx_flash.kernels.qmatmul import Arith

PROMPT = "The history of the city begins in the twelfth century, when a small market grew along the river"


def test_auto_is_exact_and_q8_is_asked_for():
    assert choose_arithmetic("auto", True, "torch on cpu").arith is Arith.EXACT
    assert choose_arithmetic("exact", True, "torch on cpu").arith is Arith.EXACT
    q8 = choose_arithmetic("q8", True, "torch on cpu")
    assert q8.arith is Arith.Q8 and "asked for" in q8.line()
    assert choose_arithmetic("auto", False, "mlx on gpu").arith is Arith.EXACT


def test_q8_where_the_products_are_float_and_an_unknown_name_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="arithmetic q8 runs in the CPU kernels; torch on cpu in bfloat16"):
        choose_arithmetic("q8", False, "torch on cpu in bfloat16")
    with pytest.raises(ConfigError, match=r"arithmetic 'int4' is unknown \(choose one of: auto, q8, exact\)"):
        choose_arithmetic("int4", True, "torch on cpu")
    with pytest.raises(ConfigError, match="arithmetic q8 runs in the CPU kernels"):
        mlx_flash.load(backend="torch", torch_dtype="bfloat16", arithmetic="q8", progress=False)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_every_exact_mode_equals_resident_within_q8(backend, capfd):
    with mlx_flash.load(backend=backend, arithmetic="q8", progress=True) as e:
        assert e.ops.arith is Arith.Q8
        ids = e.tokenizer.encode(PROMPT)
        want = greedy(e, ids, 12)
    assert "arithmetic: q8" in capfd.readouterr().err
    modes = (
        {"ffn": "stream"},
        {"ffn": "sparse", "weights_budget": "80%", "flash": mlx_flash.FlashOptions(mode="hybrid", predictor="dense")},
    )
    for kw in modes:
        with mlx_flash.load(backend=backend, arithmetic="q8", progress=False, **kw) as e:
            got = greedy(e, ids, 12)
        assert got[0] == want[0], kw
        assert np.array_equal(got[1], want[1]), kw
    with mlx_flash.load(backend=backend, arithmetic="exact", progress=False) as e:
        exact = greedy(e, ids, 12)
    assert not np.array_equal(exact[1], want[1])  # the products ran in q8
    assert np.abs(exact[1] - want[1]).max() < 0.05 * np.abs(exact[1]).max()  # and near exact's
