"""The sparse FFN on a GeGLU family (Gemma 3, tiny and random from its real config shape, FFN rows
affine 8-bit): the CPU sparse kernel's products go through the backend's gelu_tanh, so with every
neuron active a sparse decode equals the resident model bit for bit, and with a partial selection
the kernel's tokens equal the reference path's (active rows as framework weights)."""

import numpy as np
import pytest

import mlx_flash
import tiny_models
from greedy import greedy, kernel_and_reference_runs

pytest.importorskip("torch")

PROMPT = tiny_models.random_ids(12, seed=7)  # past the tiny model's window of 8


def sparse(store, backend, **flash):
    return mlx_flash.load(
        store,
        backend=backend,
        ffn="sparse",
        weights_budget="200%",
        progress=False,
        io=mlx_flash.IOOptions(mode="buffered"),
        flash=mlx_flash.FlashOptions(mode="all", **flash),
    )


@pytest.fixture
def gemma_q8(tiny_store):
    return tiny_store("gemma3_text", precision="q8")[0]


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_all_active_geglu_kernel_equals_resident(gemma_q8, backend):
    with mlx_flash.load(gemma_q8, backend=backend, ffn="resident", progress=False) as e:
        want = greedy(e, PROMPT, 10)
    with sparse(gemma_q8, backend, predictor="dense") as e:
        assert e.ffn.stats().sparse_kernel == "cpu"
        got = greedy(e, PROMPT, 10)
    assert got[0] == want[0]
    assert np.array_equal(got[1], want[1])


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_partial_geglu_selection_kernel_equals_reference_path(gemma_q8, backend):
    runs = kernel_and_reference_runs(
        lambda kernel: sparse(gemma_q8, backend, predictor="statistical", statistical_active=0.5, kernel=kernel),
        PROMPT,
        10,
    )
    assert runs["auto"][0] == runs["reference"][0]
    np.testing.assert_allclose(runs["auto"][1], runs["reference"][1], rtol=0, atol=1e-4)


def test_the_gate_activation_matters(gemma_q8):
    """A kernel path that applied silu, not gelu_tanh, would answer otherwise: the check above can fail."""
    from mlx_flash.ffn_source import GateActivation
    from mlx_flash.models import gemma3_text

    with mlx_flash.load(gemma_q8, backend="torch", ffn="resident", progress=False) as e:
        want = greedy(e, PROMPT, 4)[1]
    saved = gemma3_text.GATE_ACTIVATION
    gemma3_text.GATE_ACTIVATION = GateActivation.SILU
    try:
        with sparse(gemma_q8, "torch", predictor="dense") as e:
            got = greedy(e, PROMPT, 4)[1]
    finally:
        gemma3_text.GATE_ACTIVATION = saved
    assert np.abs(got - want).max() > 1e-3
