"""The torch backend on a CUDA device, whole models: the logits of a prompt and of decode steps agree
with the same store on the CPU (float sums run in another order on the GPU, so to a tolerance, not
bit for bit), for affine 4- and 8-bit stores (the stored product, kernels/cuda/qmatmul.cu) and a float
one, the sparse FFN source with every neuron active, a streamed FFN (bit for bit against the resident
model on the same GPU) and a MoE family, whose routed experts run in one operator call on CUDA
(moe_experts, cuda/ops_cuda.cpp) equal to the graph's call set per expert there bit for bit. Needs an NVIDIA GPU;
skipped elsewhere with the reason. The engine runs on torch alone; converting the tiny models reads
their safetensors with MLX, a base dependency."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.batching.schedule import MicroBatch, Order, run_block
from mlx_flash.service.chunk_pool import ChunkPool, ChunkShape
from mlx_flash.service.chunked_kv import ChunkTable, chunked_batch_caches

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is false)", allow_module_level=True)

IDS = list(range(3, 35))
PROMPT = 24
IO = mlx_flash.IOOptions(mode="buffered")


def run(store, device, **kw) -> tuple[np.ndarray, np.ndarray]:
    """(logits of the whole prompt, logits of decode steps after a shorter prompt) on `device`."""
    with mlx_flash.load(store, backend="torch", device=device, progress=False, io=IO, **kw) as e:
        full = e.logits(IDS)
        caches = e.new_caches()
        e.prefill(IDS[:PROMPT], caches)
        steps = np.stack([e.forward([t], caches)[-1] for t in IDS[PROMPT:]])
    return full, steps


def close(got, want, tol=1e-4):
    for g, w in zip(got, want):
        err = np.abs(g - w).max() / np.abs(w).max()
        assert g.shape == w.shape and err < tol, f"relative error {err:.1e}"
        assert np.array_equal(g.argmax(-1), w.argmax(-1))


def chunked_steps(store, device, lengths=(5, 19, 12), steps=3) -> np.ndarray:
    """The server's decode batch on `device`: contexts of `lengths` tokens prefilled alone into one
    chunk pool (8-token chunks, their slots interleaved), then `steps` steps of all of them together
    (ChunkedBatchKV); the logits of each step."""
    with mlx_flash.load(store, backend="torch", device=device, progress=False, io=IO) as e:
        a = e.args
        pool = ChunkPool(e.ops, ChunkShape(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 8), 24)
        tables = [ChunkTable(pool) for _ in lengths]
        for k, t in enumerate(tables):
            pool.allocate()  # a gap: no table's slots are consecutive with the last one's
            caches = t.caches()
            e.forward(IDS[k : k + lengths[k]], caches)
            t.tokens = caches[0].offset
        caches = [t.caches() for t in tables]
        out = []
        for step in range(steps):
            tokens = e.ops.tokens([[IDS[step + r]] for r in range(len(lengths))])
            out.append(run_block(e, [MicroBatch(tokens, chunked_batch_caches(caches))], Order.ZIGZAG)[0])
        return np.stack(out)


def test_cuda_chunked_batch_matches_cpu(tiny_store):
    """The service's decode batch over a chunk pool, whose attention on CUDA runs as plain ops over
    the rows' gathered chunks (the slot-table kernel is the CPU's): the CPU's logits."""
    store, _ = tiny_store("llama", precision="q4")
    close(chunked_steps(store, "cuda"), chunked_steps(store, "cpu"))


@pytest.mark.parametrize("precision", ["q4", "q8", "source"])
def test_cuda_model_matches_cpu(tiny_store, precision):
    store, _ = tiny_store("llama", precision=precision)
    close(run(store, "cuda"), run(store, "cpu"))


def test_cuda_streamed_equals_cuda_resident(tiny_store):
    store, _ = tiny_store("llama", precision="q4", num_hidden_layers=8)
    resident = run(store, "cuda")
    streamed = run(store, "cuda", ffn="stream", weights_budget="70%")
    assert all(np.array_equal(a, b) for a, b in zip(streamed, resident))


def test_cuda_sparse_all_active_matches_cpu(tiny_store):
    store, _ = tiny_store("llama", precision="q4")
    sparse = dict(ffn="sparse", weights_budget="120%", flash=mlx_flash.FlashOptions(mode="all", predictor="dense"))
    close(run(store, "cuda", **sparse), run(store, "cpu"))


def test_cuda_moe_matches_cpu(tiny_store):
    store, _ = tiny_store("qwen3_moe", precision="q4")
    close(run(store, "cuda"), run(store, "cpu"))


@pytest.mark.parametrize("ffn", ["resident", "stream"])
def test_cuda_grouped_experts_equal_one_call_set_per_expert(tiny_store, monkeypatch, ffn):
    from mlx_flash.backends.torch import TorchOps
    from mlx_flash.kernels import torch_ops

    store, _ = tiny_store("qwen3_moe", precision="q4")
    kw = {}
    if ffn == "stream":  # three expert slots: experts are read, evicted and read again
        with mlx_flash.load(
            store, backend="torch", device="cuda", ffn="stream", weights_budget="1GB", progress=False
        ) as e:
            a = mlx_flash.memory_plan(e)
        kw = dict(ffn="stream", weights_budget=a["resident_weights"] + 3 * a["slot_bytes"])
    calls = []
    real = torch_ops.moe_experts

    def counted(x, *a):
        calls.append(x.device.type)
        return real(x, *a)

    monkeypatch.setattr(torch_ops, "moe_experts", counted)
    grouped = run(store, "cuda", **kw)
    assert calls and set(calls) == {"cuda"}
    monkeypatch.setattr(TorchOps, "moe_experts", lambda self, *a: None)  # the graph's call set per expert
    per_expert = run(store, "cuda", **kw)
    assert all(np.array_equal(a, b) for a, b in zip(grouped, per_expert))
