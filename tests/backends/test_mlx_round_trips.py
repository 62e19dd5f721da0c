"""Host round trips per token on the MLX backend: every evaluation (mx.eval, mx.async_eval) and every
export of an MLX array to the host (item, tolist, __array__, numpy's array/asarray/ascontiguousarray/
frombuffer; a bare memoryview is not wrapped, memoryview being a type the package tests with
isinstance) is counted while the engine decodes the default model; a decode step of a
dense model costs exactly one (its logits), the products, embedding rows, attention, norms, rope and
the KV cache's append all inside the token's one graph."""

import os
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_flash

from round_trips import counted_round_trips

pytestmark = pytest.mark.slow


MODES = {
    "resident": dict(ffn="resident"),
    "stream": dict(ffn="stream"),  # every layer's FFN read per token, in turn with the graph
    "hybrid": dict(ffn="sparse", flash=mlx_flash.FlashOptions(mode="hybrid"), weights_budget="70%"),
    # auto under a weights budget that holds neither every FFN nor every layer's attention: layers stream
    "streamed layers": dict(weights_budget="40MB", context=128),
}


# hybrid (a sparse mode reading whole layers) in the full tier, ~3 s: the sparse test below covers the rest
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.full) if m == "hybrid" else m for m in MODES])
def test_a_dense_decode_step_is_one_round_trip(store_dir, mode):
    with mlx_flash.load(store_dir, backend="mlx", progress=False, **MODES[mode]) as e:
        ids = e.tokenizer.encode("The history of the city begins in the year")
        caches = e.new_caches()
        logits = e.prefill(ids, caches)
        token = int(np.argmax(logits))
        read = e.io_bytes()
        with counted_round_trips() as calls:
            for _ in range(8):
                token = int(np.argmax(e.forward([token], caches)[-1]))
        assert len(calls) == 8, f"{len(calls)} round trips for 8 tokens: {calls}"
        assert (e.io_bytes() > read) == (mode != "resident"), "the streamed modes read every token"


def test_the_counter_sees_an_export():
    """The net catches what it claims to: a product evaluated per call would be counted."""
    with counted_round_trips() as calls:
        a = mx.ones((3,)) + 1
        np.array(a)
        a.item() if a.size == 1 else a.tolist()
        mx.eval(a)
    assert calls == ["array", "tolist", "eval"]


@pytest.mark.parametrize("mode,predictor", [("all", "dense"), ("window", "statistical")])
def test_a_sparse_decode_step_is_at_most_one_round_trip_per_layer(store_dir, mode, predictor):
    """A predictor may read each layer's FFN input on the host (the I/O decision: at most one round
    trip a layer); the kernel's products over the neuron cache stay in the graph. (The caches hold every
    active row: rows past a cache take the reference path.)"""
    flash = mlx_flash.FlashOptions(mode=mode, predictor=predictor)
    with mlx_flash.load(
        store_dir,
        backend="mlx",
        ffn="sparse",
        flash=flash,
        weights_budget="200%",
        io=mlx_flash.IOOptions(mode="buffered"),
        progress=False,
    ) as e:
        ids = e.tokenizer.encode("The history of the city begins in the year")
        caches = e.new_caches()
        token = int(np.argmax(e.prefill(ids, caches)))
        with counted_round_trips() as calls:
            for _ in range(4):
                token = int(np.argmax(e.forward([token], caches)[-1]))
        layers = e.args.num_hidden_layers
        assert e.ffn.stats().sparse_kernel == "cpu"
        assert len(calls) <= 4 * (layers + 1), f"{len(calls)} round trips for 4 tokens of {layers} layers"


# ---- the streamed modes inside a memory cgroup at their planned limit --------------------------------------
# the cgroup's limit; the plan's budget is "auto" under it (the limit less its margin). What it leaves for
# weights (the measured runtime differs by ~10 MB between machines) holds the 40 MB weights budget with
# room on every machine seen; 40 MB hold the embeddings but not every layer's attention, so layers stream.
LIMIT = 270_000_000
CHILD = """
import sys
import mlx_flash
from round_trips import decode_round_trips
store, mode = sys.argv[1], sys.argv[2]
kw = dict(ffn="stream") if mode == "stream" else dict(weights_budget="40MB", context=128)
with mlx_flash.load(store, backend="mlx", progress=False, **kw) as e:
    read = e.io_bytes()
    print("round_trips", decode_round_trips(e, "The history of the city begins in the year", 8))
    print("read", e.io_bytes() - read)
    print("streamed_layers", mlx_flash.memory_plan(e).get("streamed_layers", 0))
# VmHWM: this process's own peak (ru_maxrss would carry the forking parent's over the exec)
print("peak", next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:")))
"""


@pytest.mark.parametrize("mode", ["stream", "streamed layers"])
def test_streamed_modes_keep_one_round_trip_inside_a_cgroup_at_their_limit(store_dir, mode):
    """The same count in a fresh process inside a memory cgroup, the plan's budget the automatic one
    under its limit: 8 round trips for 8 tokens, reads every token, no OOM kill, peak RSS under the
    limit."""
    from mlx_flash.errors import FlashError
    from mlx_flash.bench.cgroup import MemoryCgroup, own_memory_cgroup
    from mlx_flash.memory.limit import SAFETY_MIN

    try:
        own_memory_cgroup()
    except FlashError as e:
        pytest.skip(str(e))
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    with MemoryCgroup(LIMIT) as cg:
        r = cg.run([sys.executable, "-c", CHILD, store_dir, mode], timeout=300, env=env)
    assert r.returncode == 0 and r.oom_kills == 0, r.stderr[-2000:]
    out = dict(line.split() for line in r.stdout.splitlines() if line.strip())
    assert int(out["round_trips"]) == 8, r.stdout
    assert int(out["read"]) > 0, "a streamed mode reads every token"
    if mode == "streamed layers":
        assert int(out["streamed_layers"]) > 0, r.stdout
    budget = LIMIT - max(LIMIT * 0.05, SAFETY_MIN)  # the automatic budget under the cgroup's limit
    assert int(out["peak"]) < budget, f"peak RSS {int(out['peak']) / 1e6:.0f} MB over the {budget / 1e6:.0f} MB budget"
