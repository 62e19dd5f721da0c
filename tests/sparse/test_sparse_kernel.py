"""The sparse FFN kernel inside the engine, on the default model's own store (bundles of 32-neuron
blocks, the source's 4-bit bytes): the backend picks it at load and the stats name it; with every
neuron active a sparse decode equals the resident model bit for bit; with a partial selection the
kernel's greedy text and logits equal the reference path's (active rows as framework weights)."""

import numpy as np
import pytest

import mlx_flash
from greedy import greedy, kernel_and_reference_runs

PROMPT = [1, 504, 3458, 282, 4649, 314]  # a fixed token prompt: no tokenizer in the comparison


def load(store, backend, arithmetic="auto", **flash):
    return mlx_flash.load(
        store,
        backend=backend,
        ffn="sparse",
        weights_budget="200%",
        progress=False,
        io=mlx_flash.IOOptions(mode="buffered"),
        arithmetic=arithmetic,
        flash=mlx_flash.FlashOptions(mode="all", **flash),
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_all_active_kernel_equals_resident(store_dir, backend):
    with mlx_flash.load(store_dir, backend=backend, progress=False) as e:
        want = greedy(e, PROMPT, 12)
    with load(store_dir, backend, predictor="dense") as e:
        assert e.ffn.stats().sparse_kernel == "cpu"
        got = greedy(e, PROMPT, 12)
    assert got[0] == want[0] and np.array_equal(got[1], want[1])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_partial_selection_kernel_equals_reference_path(store_dir, backend):
    """The statistical predictor draws half the blocks per token from a fixed seed: the same
    selections on both paths, so the same tokens, and logits equal up to float32 summation order
    (the kernel adds the active blocks in neuron order, as the resident model does; the reference
    path multiplies the cache's rows in slot order). In the float arithmetic: the reference path's
    down rows are neuron-major, which the q8 kernels do not read, so under q8 the two paths would
    compute down in different arithmetics."""
    runs = kernel_and_reference_runs(
        lambda kernel: load(
            store_dir, backend, "exact", predictor="statistical", statistical_active=0.5, kernel=kernel
        ),
        PROMPT,
        12,
    )
    assert runs["auto"][0] == runs["reference"][0]
    np.testing.assert_allclose(runs["auto"][1], runs["reference"][1], rtol=0, atol=1e-2)
