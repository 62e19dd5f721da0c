"""A MoE layer's routed experts as one grouped kernel call (ops.moe_experts) inside the model: the
logits equal, bit for bit, those of one call set per expert (models/moe.py's `routed_experts`, run
when the backend's grouped kernel is switched off), resident and streamed, on both backends: tiny
models of every MoE family (affine 4-bit and 8-bit experts, converted from floats) and synthetic
Qwen3-MoE GGUFs (Q4_1 experts multiplied where they are read, and the Q4_K_M mix's block kinds).
The graph's routing (ops.route) matches the plain-ops reference (models/moe.py's `route`). On MLX a
resident MoE decode step is one host round trip (its logits), a streamed one a round trip per layer
(the routing the reads need) and one for the logits."""

import numpy as np
import pytest

import mlx_flash
import tiny_models
from mlx_flash.backends import get_backend
from mlx_flash.backends.mlx import MLXOps
from mlx_flash.backends.torch import TorchOps
from mlx_flash.convert import convert
from greedy import greedy
from mlx_flash.models.moe import route
from moe_files import write_moe_gguf
from round_trips import decode_round_trips

pytest.importorskip("torch")

BACKENDS = {"mlx": MLXOps, "torch": TorchOps}
IO = mlx_flash.IOOptions(mode="buffered")


def logits(store, backend, ids, **kw):
    with mlx_flash.load(store, backend=backend, progress=False, io=IO, **kw) as e:
        return np.asarray(e.forward(ids, e.new_caches(), all_logits=True)), e.ffn


@pytest.fixture(scope="module")
def gguf_stores(moe_store, tmp_path_factory):
    """quant -> a store of the small Qwen3-MoE GGUF (tests/moe/conftest.py) in that quantization."""
    path = write_moe_gguf(str(tmp_path_factory.mktemp("q4_1") / "m.gguf"), "Q4_1")
    return {"Q4_K_M": moe_store, "Q4_1": convert(path, path + ".store", progress=False)}


def three_slots(store, backend) -> int:
    """A weights budget that leaves the expert cache three slots."""
    with mlx_flash.load(store, backend=backend, ffn="stream", weights_budget="1GB", progress=False, io=IO) as e:
        plan = mlx_flash.memory_plan(e)
    return plan["resident_weights"] + 3 * plan["slot_bytes"]


def grouped_and_per_expert(store, backend, ids, monkeypatch, **kw):
    """(logits with the grouped kernel, which must have run every time; logits with it switched off)."""
    cls = BACKENDS[backend]
    real, answers = cls.moe_experts, []

    def counted(self, *a):
        answers.append(real(self, *a))
        return answers[-1]

    monkeypatch.setattr(cls, "moe_experts", counted)
    grouped, ffn = logits(store, backend, ids, **kw)
    assert answers and all(a is not None for a in answers)
    monkeypatch.setattr(cls, "moe_experts", lambda self, *a: None)
    per_expert, _ = logits(store, backend, ids, **kw)
    monkeypatch.setattr(cls, "moe_experts", real)
    return grouped, per_expert, ffn


@pytest.mark.parametrize("backend", list(BACKENDS))
# the kernel is the same for every family: Qwen2-MoE (a shared expert beside) and Qwen3-MoE (renormalized
# weights) in 4 bits, Mixtral in 8 (every family against transformers: test_moe_models.py)
@pytest.mark.parametrize("family,precision", [("qwen2_moe", "q4"), ("qwen3_moe", "q4"), ("mixtral", "q8")])
def test_grouped_equals_one_call_set_per_expert(tiny_store, family, precision, backend, monkeypatch):
    store, _ = tiny_store(family, precision=precision)
    ids = tiny_models.random_ids(12, seed=7)
    grouped, per_expert, _ = grouped_and_per_expert(store, backend, ids, monkeypatch)
    assert np.array_equal(grouped, per_expert)
    streamed, per_expert_streamed, ffn = grouped_and_per_expert(
        store, backend, ids, monkeypatch, ffn="stream", weights_budget=three_slots(store, backend)
    )
    assert ffn.cache.slots == 3  # waves: fewer slots than the experts a 12-token prompt routes to
    assert np.array_equal(streamed, per_expert_streamed) and np.array_equal(streamed, grouped)


# each backend on one quant in the default tier (MLX the block kinds, torch the in-place Q4_1), both
# on both in the full tier
@pytest.mark.parametrize(
    "backend,quant",
    [
        ("mlx", "Q4_K_M"),
        ("torch", "Q4_1"),
        pytest.param("mlx", "Q4_1", marks=pytest.mark.full),
        pytest.param("torch", "Q4_K_M", marks=pytest.mark.full),
    ],
)
def test_grouped_equals_one_call_set_per_expert_on_gguf_experts(gguf_stores, quant, backend, monkeypatch):
    store = gguf_stores[quant]
    ids = list(range(5, 21))
    grouped, per_expert, _ = grouped_and_per_expert(store, backend, ids, monkeypatch)
    assert np.array_equal(grouped, per_expert)
    streamed, per_expert_streamed, ffn = grouped_and_per_expert(
        store, backend, ids, monkeypatch, ffn="stream", weights_budget=three_slots(store, backend)
    )
    assert ffn.cache.slots == 3
    assert np.array_equal(streamed, per_expert_streamed) and np.array_equal(streamed, grouped)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_route_matches_the_plain_ops_reference(backend):
    ops = get_backend(backend)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((9, 16)).astype(np.float32) * 3
    for k, renorm, unit in ((2, False, False), (4, True, False), (3, False, True)):
        ids, w = ops.routing_to_host(*ops.route(ops.array(z, cast=False), k, renorm, unit))
        want_ids, want_w = route(z, k, renorm, unit)
        assert ids.dtype == np.int32 and np.array_equal(ids, want_ids)
        np.testing.assert_allclose(w, want_w, rtol=1e-6, atol=1e-7)


def test_mlx_moe_decode_round_trips(gguf_stores):
    store = gguf_stores["Q4_1"]  # experts multiplied where they are read: nothing converted per miss
    prompt = list(range(5, 15))
    with mlx_flash.load(store, backend="mlx", progress=False) as e:
        assert decode_round_trips(e, prompt, 8) == 8  # resident: its logits only
        layers = e.args.num_hidden_layers
    with mlx_flash.load(
        store, backend="mlx", ffn="stream", weights_budget=three_slots(store, "mlx"), progress=False, io=IO
    ) as e:
        assert decode_round_trips(e, prompt, 8) == 8 * (layers + 1)  # the routing of each layer, the logits


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_streamed_equals_resident_for_64_tokens_at_every_budget(gguf_stores, backend):
    """Q4_1 experts through the grouped kernel: 64 greedy tokens and every step's logits of the
    resident model, with 10%, 50% and 100% of the expert bytes cached."""
    store, prompt = gguf_stores["Q4_1"], list(range(5, 15))
    with mlx_flash.load(store, backend=backend, progress=False) as e:
        want = greedy(e, prompt, 64)
    with mlx_flash.load(store, backend=backend, ffn="stream", weights_budget="1GB", progress=False, io=IO) as e:
        plan = mlx_flash.memory_plan(e)
    for share in (0.1, 0.5, 1.0):
        budget = plan["resident_weights"] + max(plan["slot_bytes"], int(share * plan["all_experts_bytes"]))
        with mlx_flash.load(store, backend=backend, ffn="stream", weights_budget=budget, progress=False, io=IO) as e:
            got = greedy(e, prompt, 64)
        assert got[0] == want[0], f"{share:.0%} of expert bytes"
        assert np.array_equal(got[1], want[1])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_streamed_experts_equal_resident_within_q8(gguf_stores, backend):
    """The q8 arithmetic keeps streamed experts exact against resident ones: Q4_1 and the Q4_K_M mix,
    a tenth of the expert bytes cached, 16 greedy tokens and every step's logits."""
    prompt = list(range(5, 15))
    for quant, store in gguf_stores.items():
        with mlx_flash.load(store, backend=backend, arithmetic="q8", progress=False) as e:
            want = greedy(e, prompt, 16)
        with mlx_flash.load(
            store, backend=backend, arithmetic="q8", ffn="stream", weights_budget="1GB", progress=False, io=IO
        ) as e:
            plan = mlx_flash.memory_plan(e)
        budget = plan["resident_weights"] + max(plan["slot_bytes"], plan["all_experts_bytes"] // 10)
        with mlx_flash.load(
            store, backend=backend, arithmetic="q8", ffn="stream", weights_budget=budget, progress=False, io=IO
        ) as e:
            got = greedy(e, prompt, 16)
        assert got[0] == want[0], quant
        assert np.array_equal(got[1], want[1]), quant
