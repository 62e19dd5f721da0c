"""Every write the package makes, and every read of a streamed generation, failed one at a time
(tests/fault_injection.py): each operation on a tiny model refuses in one line or absorbs the fault,
leaves nothing half-written that its reader takes for good, and works when run again. With -s each
operation prints its injection points by kind. The default tier runs every point of the cheap
operations and a stride of the others; the full tier runs every point of every operation."""

from __future__ import annotations

import itertools
import traceback
import os
import shutil

import numpy as np
import pytest

import fault_injection as fi
import mlx_flash
import tiny_models
from fuzz_helpers import templated_store
from mlx_flash.errors import DiskError
from mlx_flash.memory import ModelShape
from mlx_flash.models.kv_tiers import EVICT_STEP, TierPlan
from mlx_flash.sparse.predictor import LayerPredictor, Predictors
from mlx_flash.sparse.thresholds import PERCENTS, ROLES, Thresholds, load_thresholds, save_thresholds
from mlx_flash.sparse.thresholds import store_fingerprint
from mlx_flash.store.kv_tier_file import KVTierFile
from mlx_flash.store.positional_io import write_all

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


def show(report: fi.Report) -> None:
    """Print the report's line; a known bug that broke a rule marks the test xfail, naming it."""
    print("\n" + report.line())
    for _, broke in report.known.values():
        print(f"[faults]   a known bug: {broke}")
    if report.known:
        pytest.xfail("; ".join(sorted({reason for reason, _ in report.known.values()})))


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


# ---- sparsity thresholds beside a store -----------------------------------------------------------


def linked_store(store: str, work) -> str:
    """A copy of the store whose files are hard links (the operations here add files beside them)."""
    copy = work()
    shutil.copytree(store, copy, copy_function=os.link)
    return copy


def leftovers(folder: str) -> list[str]:
    return [n for n in os.listdir(folder) if ".tmp" in n]


def thresholds_op(store, work) -> fi.Operation:

    opened = mlx_flash.store.open_store(store)
    layers = opened.config["num_hidden_layers"]
    rng = np.random.default_rng(0)
    found = Thresholds(
        {r: np.sort(rng.random((layers, PERCENTS), dtype=np.float32), axis=1) for r in ROLES},
        store_fingerprint(opened),
        {"corpus": "synthetic"},
    )

    def setup():
        return mlx_flash.store.open_store(linked_store(store, work))  # (its checksums stamped here)

    def run(opened):
        save_thresholds(opened, found)
        return found.to_json()

    def read_back(opened):
        assert leftovers(opened.path) == [], leftovers(opened.path)
        return load_thresholds(mlx_flash.store.open_store(opened.path), layers).to_json()

    return fi.Operation("sparsity thresholds", setup, run, read_back)


def test_thresholds_file_under_every_fault(store, work):
    report = fi.check(thresholds_op(store, work))
    show(report)
    assert report.by_kind() == {"write": 1, "fsync": 2, "rename": 1}  # one file, written durably


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
LAYERS_BUG = (
    "mlx_flash/layer_stream.py: a streamed layer's read ahead that failed is raised again by the next "
    "generation, which has no fault (LayerStream._drop_pending waits on the failed batch it kept); the "
    "ffn reader reads such a layer again"
)


STREAMED_BUGS = {"ffn": {}, "layers": {"run again without the fault, it raised ReadError": LAYERS_BUG}}


@pytest.mark.parametrize("how", list(STREAMED))
def test_streamed_generation_under_every_read_fault(deep_store, how):
    """A read that fails (EIO) or comes back short: the generation refuses in one line or reads
    again, and the next generation without the fault is the fault-free one, bit for bit."""
    with mlx_flash.load(deep_store, backend="torch", progress=False, **STREAMED[how]) as e:
        report = fi.check(fi.Operation(f"streamed generation ({how})", lambda: e, greedy_run), known=STREAMED_BUGS[how])
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


TIERS_BUG = (
    "mlx_flash/models/kv_tiers.py: a read ahead of the next layer's tokens on flash that failed is "
    "raised by the next sequence, which has no fault (TierReads._wait_ahead takes the failed future "
    "of the sequence before: KVTierError 'cannot read it (Input/output error)'); which point hits it "
    "depends on the reader threads"
)


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.full), 7])
def test_kv_tier_spill_under_every_fault(store, work, stride):
    op, engine = kv_tier_op(store, work)
    with engine:
        report = fi.check(op, stride=stride, known={"run again without the fault, it raised KVTierError": TIERS_BUG})
    show(report)
    kinds = report.by_kind()
    assert kinds["fallocate"] == 1 and kinds["write"] >= 8 and kinds["read"] >= 8


# ---- a conversion into a store ---------------------------------------------------------------------


def store_files(path: str) -> dict:
    """What a store reader finds: the store opened (its manifest checked, every file hashed against
    it), then every file's bytes."""
    mlx_flash.store.open_store(path)
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("faults-hf") / "hf")
    tiny_models.build("llama", out)
    return out


LOCK_BUG = (
    "mlx_flash/store/atomic_dir.py output_lock: the os.pwrite of the writer's pid into the lock file is "
    "outside any OSError handler: a full disk there escapes as a bare OSError with a traceback"
)
CONVERSION_BUGS = {"mlx_flash.store.atomic_dir:output_lock": LOCK_BUG}


def conversion_op(hf_dir, work) -> fi.Operation:
    def run(parent):
        out = mlx_flash.convert(hf_dir, os.path.join(parent, "store"), force=True, progress=False)
        return store_files(out)

    def read_back(parent):
        path = os.path.join(parent, "store")
        return store_files(path) if os.path.exists(path) else fi.ABSENT

    return fi.Operation("conversion into a store", work, run, read_back)


def test_conversion_under_every_fault(hf_dir, work):
    report = fi.check(conversion_op(hf_dir, work), known=CONVERSION_BUGS)
    show(report)
    assert report.by_kind()["fsync"] >= 4 and report.by_kind()["rename"] >= 1


# ---- sparsity predictors beside a store ------------------------------------------------------------


def predictors(layers: int, d: int, f: int, seed: int):

    rng = np.random.default_rng(seed)
    per = [
        LayerPredictor(rng.random((d, 4), np.float32), rng.random((4, f), np.float32), rng.random(f, np.float32), 0.1)
        for _ in range(layers)
    ]
    cuts = [0.1 * (seed + 1)] * layers
    return Predictors(per, 0.5, [0.01 * (seed + 1)] * layers, cuts_by_recall={"0.9": cuts}, recall="0.9")


def predictor_op(store, work) -> fi.Operation:
    """New predictors saved over older ones of the same shapes (a retraining); read back: each
    layer's U, V, b and cut, the magnitude thresholds."""

    cfg = mlx_flash.store.open_store(store).config
    shape = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"])
    old, new = predictors(*shape, seed=0), predictors(*shape, seed=1)

    def setup():
        path = linked_store(store, work)
        old.save(path)
        return path

    def run(path):
        new.save(path)
        return read_back(path)

    def read_back(path):
        assert leftovers(path) == [], leftovers(path)
        p = Predictors.load(path, *shape)
        return [(x.U, x.V, x.b, x.cut) for x in p.layers], p.magnitude_thresholds, p.cuts_by_recall

    return fi.Operation("sparsity predictors", setup, run, read_back)


PREDICTOR_BUG = (
    "mlx_flash/sparse/predictor.py Predictors.save: the weights file is replaced, then the json; a "
    "failure (or a crash) between the two leaves the new weights beside the old json (cuts, magnitude "
    "thresholds), which loads as good when the shapes agree (a retraining of the same ranks)"
)


def test_predictor_files_under_every_fault(store, work):
    report = fi.check(predictor_op(store, work), known={"neither the old one nor the new one": PREDICTOR_BUG})
    show(report)
    assert report.by_kind()["fsync"] >= 4 and report.by_kind()["rename"] == 2  # two files


# ---- the harness itself: it shows a bug's traceback, and a bad file read as good -------------------


def test_a_bug_under_a_fault_fails_showing_its_traceback(store, work):
    """A TypeError raised at the first write (a stand-in for a bug the fault reaches) fails the check
    with FaultEscaped chained to it: its traceback, through the package's frames, is shown."""
    bug = TypeError("a bug at the first write")
    with pytest.raises(fi.FaultEscaped, match="TypeError escaped") as e:
        fi.check(thresholds_op(store, work), bug=bug)
    assert e.value.__cause__ is bug
    frames = [f.name for f in traceback.extract_tb(bug.__traceback__)]
    assert "save_thresholds" in frames and "write" in frames, frames


def test_a_file_written_in_place_is_caught_half_written(work):
    """A file written in two parts in place (no temporary, no rename): a failed part leaves a file
    (empty, or half) that its reader takes for the whole: the check says so."""

    data = bytes(range(256)) * 64

    def run(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for at in (0, len(data) // 2):
                write_all(fd, memoryview(data[at : at + len(data) // 2]), at)
        except OSError as e:
            raise DiskError(f"{path}: {e.strerror}") from None
        finally:
            os.close(fd)
        return data

    def read_back(path):
        if not os.path.exists(path):
            return fi.ABSENT
        with open(path, "rb") as f:
            return f.read()

    op = fi.Operation("a file written in place", lambda: work() + ".bin", run, read_back)
    with pytest.raises(fi.FaultEscaped, match="point 0 .*neither the old one nor the new one"):
        fi.check(op)
