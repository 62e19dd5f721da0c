"""Faults while the package serves and generates (tests/fault_injection.py), on a tiny model: a
context's chunks swapped out and read back by its next call, a streamed generation's reads, a long
sequence's older KV spilled to flash and read back. Each refuses in one line or absorbs the fault,
leaves nothing half-written that its reader takes for good, and works when run again; with -s each
prints its injection points by kind. The default tier runs every point but the KV tier's (a stride);
the full tier runs every point."""

from __future__ import annotations

import itertools
import os
import shutil

import numpy as np
import pytest

import fault_injection as fi
import mlx_flash
import tiny_models
from fault_injection import show
from fuzz_helpers import templated_store
from mlx_flash.memory import ModelShape
from mlx_flash.models.kv_tiers import EVICT_STEP, TierPlan
from mlx_flash.store.kv_tier_file import KVTierFile

PROMPT = " ".join(f"w{3 + (7 * i) % 90}" for i in range(40))  # 40 tokens: three chunks of 16
MORE = "w5 w6 w7"
_folders = itertools.count()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return templated_store(tmp_path_factory.mktemp("faults-store"))


@pytest.fixture(scope="module")
def engine(store):
    with mlx_flash.load(store, backend="torch", progress=False) as e:
        yield e


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A fresh folder per call (one per faulted run)."""
    root = tmp_path_factory.mktemp("faults")
    return lambda: str(root / f"run{next(_folders)}")


def _answer(svc, ctx, text, n=4) -> str:
    return "".join(s.text for s in svc.call(ctx, text, max_tokens=n, temperature=0.0))


# ---- the service: a context's chunks swapped out, its record --------------------------------------


def service_op(engine, work) -> fi.Operation:
    """swap_out of a three-chunk context; read back by a new service on a copy of the folder: the
    context's tokens and its answer to one more prompt (ABSENT when the service does not hold it)."""

    def setup():
        directory = work()
        svc = mlx_flash.Service(engine, directory=directory, kv_budget="4MB")
        ctx = svc.new_context()
        _answer(svc, ctx, PROMPT)
        return svc, ctx, directory

    def run(state):
        svc, ctx, _ = state
        return svc.swap_out(ctx)

    def read_back(state):
        _, ctx, directory = state
        copy = work()
        shutil.copytree(directory, copy)
        with mlx_flash.Service(engine, directory=copy, kv_budget="4MB") as other:
            if ctx not in other.contexts:
                assert any(ctx in p for p in other.problems) or not os.path.exists(
                    os.path.join(copy, "contexts", ctx, "context.json")
                ), other.problems
                return fi.ABSENT
            return other.get(ctx).sequence[:], _answer(other, ctx, MORE)

    return fi.Operation("chunk swap and context record", setup, run, read_back, lambda state: state[0].close())


def test_swap_out_under_every_fault(engine, work):
    report = fi.check(service_op(engine, work))
    show(report)
    kinds = report.by_kind()
    assert kinds["write"] >= 3 and kinds["fsync"] >= 4 and report.runs == len(report.points) + kinds["write"]


def restore_op(engine, work) -> fi.Operation:
    """A call on a swapped-out context: its chunk files read back (a failed read: the chunk is
    recomputed), then its record written. The call is the whole text, so running it again asks the
    same; read back as service_op's is."""
    swapped = service_op(engine, work)

    def setup():
        state = swapped.setup()
        state[0].swap_out(state[1])
        return state

    def run(state):
        svc, ctx, _ = state
        return "".join(s.text for s in svc.call(ctx, PROMPT + " " + MORE, max_tokens=4, whole=True))

    return fi.Operation("a swapped-out context's next call", setup, run, swapped.read_back, swapped.teardown)


def test_restore_under_every_fault(engine, work):
    report = fi.check(restore_op(engine, work))
    show(report)
    assert report.by_kind()["read"] >= 3 and report.by_kind()["write"] >= 1  # the chunks, the record


# ---- streamed weights: a read of a generation fails ------------------------------------------------


def greedy_run(e, n=3):
    """Tokens and every step's logits of a greedy run from a fixed prompt."""
    caches, ids = e.new_caches(), tiny_models.random_ids(12, seed=3)
    logits, seen = np.asarray(e.forward(ids, caches)).reshape(-1), []
    for _ in range(n):
        seen.append(logits)
        logits = np.asarray(e.forward([int(np.argmax(logits))], caches)).reshape(-1)
    seen.append(logits)
    return np.stack(seen)


@pytest.fixture(scope="module")
def deep_store(tmp_path_factory) -> str:
    """Six layers: more than a streamed FFN's two buffers hold, so every forward reads."""
    root = tmp_path_factory.mktemp("faults-deep")
    tiny_models.build("llama", str(root / "hf"), num_hidden_layers=6)
    return mlx_flash.convert(str(root / "hf"), str(root / "store"), precision="q4", progress=False)


STREAMED = {"ffn": dict(ffn="stream"), "layers": dict(ffn="stream", weights_budget="70%")}


@pytest.mark.parametrize("how", list(STREAMED))
def test_streamed_generation_under_every_read_fault(deep_store, how):
    """A read that fails (EIO) or comes back short: the generation refuses in one line or reads
    again, and the next generation without the fault is the fault-free one, bit for bit."""
    with mlx_flash.load(deep_store, backend="torch", progress=False, **STREAMED[how]) as e:
        report = fi.check(fi.Operation(f"streamed generation ({how})", lambda: e, greedy_run), known={})
    show(report)
    assert report.by_kind()["read"] >= 6 * 4  # every layer of every forward


# ---- a long sequence's older KV on flash (the KV tier file) ----------------------------------------


def kv_tier_op(store, work) -> fi.Operation:
    """A 150-token prefill in chunks of 16 and four greedy steps with a window of 80 tokens: the
    older tokens moved to a nameless file on flash and read back at every forward."""

    engine = mlx_flash.load(store, backend="torch", progress=False, prefill_chunk=16)
    s = ModelShape.from_config(engine.store.config)
    ids = tiny_models.random_ids(150, seed=5)

    def setup():
        folder = os.path.join(work(), "kv")
        engine.kv_tiers = TierPlan(
            EVICT_STEP + 16,
            16,
            256,
            s.layers,
            s.kv_heads,
            s.head_dim,
            lambda: KVTierFile(folder, s.layers, s.kv_heads, s.head_dim, 256),
        )
        return folder

    def run(folder):
        caches = engine.new_caches()
        out = [engine.prefill(ids, caches, all_logits=True)]
        for _ in range(4):
            out.append(engine.forward([int(np.argmax(out[-1][-1]))], caches))
        return np.concatenate(out)

    def read_back(folder):
        assert not os.path.isdir(folder) or os.listdir(folder) == []  # the file never has a name
        return None

    return fi.Operation("KV tier spill", setup, run, read_back), engine


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.full), 7])
def test_kv_tier_spill_under_every_fault(store, work, stride):
    op, engine = kv_tier_op(store, work)
    with engine:
        report = fi.check(op, stride=stride)
    show(report)
    kinds = report.by_kind()
    assert kinds["fallocate"] == 1 and kinds["write"] >= 8 and kinds["read"] >= 8
