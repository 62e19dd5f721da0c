"""A power loss at every point of a conversion's writes and of a context's swap-out (tests/crash_states.py):
every state it can leave, every write that was not fsynced dropped, is written out and read by the
package's own reader, which finds nothing, refuses in one line, or finds exactly what the finished
operation wrote: never a bad store or context read as good. With -s each prints the states checked."""

from __future__ import annotations

import itertools
import os
import shutil

import numpy as np
import pytest

import crash_states as cs
from fault_injection import store_files
import mlx_flash
import tiny_models
from mlx_flash.errors import FlashError
from mlx_flash.sparse.predictor import LayerPredictor, Predictors

_folders = itertools.count()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    return lambda: str(root / f"s{next(_folders)}")


def check_states(name: str, root: str, operation, read, reference, again=None, earlier=()) -> None:
    """Trace `operation` under `root`; every distinct power-loss state of each model, written out,
    must read (by `read(folder)`) as None (nothing there), a one-line FlashError, `reference`, or one
    of `earlier` (what the operation's own steps leave, each complete); the state once it returned
    must read as `reference` (it is durable); and `again(folder)` (the operation run again there,
    when given) must then give `reference`."""
    states, points = cs.trace(root, operation)
    lines = []
    for model, found in states.items():
        seen = {"nothing": 0, "refused": 0, "an earlier step": 0, "the finished result": 0}
        for k, state in found[:-1]:
            where = f"{name}, a power loss at point {k} ({model} model: {cs.describe(state)})"
            folder = cs.materialize(state, os.path.join(os.path.dirname(root), f"state{next(_folders)}"))
            try:
                got = read(folder)
            except FlashError as e:
                assert "\n" not in str(e) and str(e).strip(), f"{where}: {e!r}"
                got = "refused"
            if got is None or got == "refused":
                seen["nothing" if got is None else "refused"] += 1
            elif got in earlier:
                seen["an earlier step"] += 1
            else:
                assert got == reference, f"{where}: read as good, but it is not the finished result"
                seen["the finished result"] += 1
            if again is not None:
                assert again(folder) == reference, f"{where}: run again there, it does not give the result"
        k, state = found[-1]
        folder = cs.materialize(state, os.path.join(os.path.dirname(root), f"state{next(_folders)}"))
        assert read(folder) == reference, (
            f"{name}: a power loss once it returned ({model} model: {cs.describe(state)}) loses the result"
        )
        said = ", ".join(f"{n} {k}" for k, n in seen.items() if n)
        lines.append(
            f"[crash]   {model} model: {len(found) - 1} distinct states checked ({said}) and the one once it returned"
        )
    print(f"\n[crash] {name}: {points} points traced\n" + "\n".join(lines))


# ---- a conversion ----------------------------------------------------------------------------------


def test_conversion_power_loss_states(tmp_path, work):
    hf = str(tmp_path / "hf")
    tiny_models.build("llama", hf)
    reference = store_files(mlx_flash.convert(hf, str(tmp_path / "reference"), progress=False))
    root = work()
    os.makedirs(root)

    def read(folder):
        path = os.path.join(folder, "store")
        return store_files(path) if os.path.exists(path) else None

    def again(folder):
        return store_files(mlx_flash.convert(hf, os.path.join(folder, "store"), force=True, progress=False))

    check_states(
        "conversion",
        root,
        lambda: mlx_flash.convert(hf, os.path.join(root, "store"), progress=False),
        read,
        reference,
        again,
    )


# ---- a context's swap-out: its chunk files and its record ------------------------------------------

PROMPT = " ".join(f"w{3 + (7 * i) % 90}" for i in range(40))


def _answer(svc, ctx, text, n=4) -> str:
    return "".join(s.text for s in svc.call(ctx, text, max_tokens=n, temperature=0.0))


def test_context_swap_out_power_loss_states(tmp_path, work):
    from fuzz_helpers import templated_store

    with mlx_flash.load(templated_store(tmp_path), backend="torch", progress=False) as engine:
        root = work()
        svc = mlx_flash.Service(engine, directory=root, kv_budget="4MB")
        ctx = svc.new_context()
        _answer(svc, ctx, PROMPT)
        with mlx_flash.Service(engine, directory=work(), kv_budget="4MB") as twin:  # never swapped out
            t = twin.new_context()
            _answer(twin, t, PROMPT)
            reference = (twin.get(t).sequence[:], _answer(twin, t, "w5 w6 w7"))

        def read(folder):
            with mlx_flash.Service(engine, directory=folder, kv_budget="4MB") as other:
                if ctx not in other.contexts:
                    return None
                return other.get(ctx).sequence[:], _answer(other, ctx, "w5 w6 w7")

        check_states("context swap-out", root, lambda: svc.swap_out(ctx), read, reference)
        svc.close()


def test_new_context_power_loss_states(tmp_path, work):
    """A service made in a new folder, a new context, its first call and its swap-out: a power loss
    leaves no context, the empty one, or the one with its call; once swap_out returned, that one."""
    from fuzz_helpers import templated_store

    with mlx_flash.load(templated_store(tmp_path), backend="torch", progress=False) as engine:
        root = work()
        os.makedirs(root)
        made = {}

        def operation():
            svc = made["svc"] = mlx_flash.Service(engine, directory=os.path.join(root, "svc"), kv_budget="4MB")
            made["ctx"] = svc.new_context()
            _answer(svc, made["ctx"], PROMPT)
            svc.swap_out(made["ctx"])

        def read(folder):
            with mlx_flash.Service(engine, directory=os.path.join(folder, "svc"), kv_budget="4MB") as other:
                if made["ctx"] not in other.contexts:
                    return None
                return other.get(made["ctx"]).sequence[:], _answer(other, made["ctx"], "w5 w6 w7")

        with mlx_flash.Service(engine, directory=work(), kv_budget="4MB") as twin:
            empty = twin.new_context()
            earlier = (twin.get(empty).sequence[:], _answer(twin, empty, "w5 w6 w7"))
            t = twin.new_context()
            _answer(twin, t, PROMPT)
            reference = (twin.get(t).sequence[:], _answer(twin, t, "w5 w6 w7"))
        check_states("a new context", root, operation, read, reference, earlier=[earlier])
        made["svc"].close()


# ---- sparsity predictors retrained: two files replaced one after the other --------------------------


def _predictors(layers: int, d: int, f: int, seed: int) -> Predictors:
    rng = np.random.default_rng(seed)
    per = [
        LayerPredictor(rng.random((d, 4), np.float32), rng.random((4, f), np.float32), rng.random(f, np.float32), seed)
        for _ in range(layers)
    ]
    return Predictors(per, 0.5, [0.01 * (seed + 1)] * layers)


def test_predictors_power_loss_states(tmp_path, work):
    """New predictors saved over older ones of the same shapes: a power loss leaves the old pair, the
    new pair, or a mix that load refuses; never new weights read with the old cuts."""
    from fuzz_helpers import templated_store

    store = templated_store(tmp_path)
    cfg = mlx_flash.store.open_store(store).config
    shape = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"])
    old, new = _predictors(*shape, seed=0), _predictors(*shape, seed=1)
    root = work()
    shutil.copytree(store, root)
    old.save(root)

    def read(folder):
        p = Predictors.load(folder, *shape)
        return [(x.U.tobytes(), x.V.tobytes(), x.b.tobytes(), x.cut) for x in p.layers], p.magnitude_thresholds

    earlier = read(root)
    probe = work()
    shutil.copytree(root, probe)
    new.save(probe)
    reference = read(probe)
    check_states("predictors retrained", root, lambda: new.save(root), read, reference, earlier=[earlier])


# ---- the simulator itself: a write that is not durable is caught ------------------------------------


# Two writers: in place (its folder fsynced, the file not), and the durable way (a temporary, fsynced,
# renamed over the file, its folder fsynced). Their module is named as the package's, since the trace
# follows mlx_flash code only.
WRITERS = """
import os

def sync_folder(root):
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)

def in_place(root, data):
    fd = os.open(os.path.join(root, "file"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, data)
    os.close(fd)
    sync_folder(root)

def durable(root, data):
    fd = os.open(os.path.join(root, "file.tmp"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    os.replace(os.path.join(root, "file.tmp"), os.path.join(root, "file"))
    sync_folder(root)
"""


def _writer(how: str):
    module = {"__name__": "mlx_flash_test_writers"}
    exec(compile(WRITERS, "test_writers.py", "exec"), module)
    return module[how]


def _read_file(folder):
    path = os.path.join(folder, "file")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def test_a_file_whose_data_is_not_fsynced_is_caught(work):
    """Written in place, its name survives (the folder was fsynced) while its bytes do not: the empty
    file is read as the file, and the check says so; written the durable way, every state passes."""
    data = b"the whole file" * 100
    for how in ("in_place", "durable"):
        root = work()
        os.makedirs(root)
        run = lambda: _writer(how)(root, data)  # noqa: E731
        if how == "in_place":
            with pytest.raises(AssertionError, match="read as good, but it is not the finished result"):
                check_states(how, root, run, _read_file, data)
        else:
            check_states(how, root, run, _read_file, data)


def test_a_write_the_simulator_does_not_see_is_said(work):
    """A write through builtin open (not an os call the trace models) makes the model differ from the
    disk: the trace refuses rather than check states that are wrong."""
    from mlx_flash.durable import sync_folder

    root = work()
    os.makedirs(root)

    def operation():
        with open(os.path.join(root, "unseen"), "wb") as f:
            f.write(b"x")
        sync_folder(root)

    with pytest.raises(AssertionError, match="written by a call it does not trace"):
        cs.trace(root, operation)
