"""Shared fixtures. Real-model fixtures skip with a reason when the default model package or the
fetched corpora are missing, unless MLX_FLASH_REQUIRE_DATA=1 (CI), where that is a failure."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from mlx_flash.errors import ModelNotFoundError  # noqa: E402

REQUIRE = os.environ.get("MLX_FLASH_REQUIRE_DATA") == "1"
FULL = os.environ.get("MLX_FLASH_FULL") == "1"


def pytest_configure(config):
    """Each xdist worker keeps to its own share of the CPUs (its affinity mask, which the engine's
    thread counts and the subprocesses it starts follow): two workers each running every core's worth
    of threads on the same cores spend time switching and spinning."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):  # one process, or macOS
        return
    cpus, n, i = sorted(os.sched_getaffinity(0)), int(count), int(worker.removeprefix("gw"))
    if len(cpus) >= n:
        os.sched_setaffinity(0, cpus[i % n :: n])


def pytest_collection_modifyitems(config, items):
    """Tests marked `full` run only in the full tier (MLX_FLASH_FULL=1): the default one stays under
    15 minutes on a 2-core machine."""
    if FULL:
        return
    skip = pytest.mark.skip(reason="full tier only: MLX_FLASH_FULL=1 (make test-full)")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


def _missing(reason: str):
    if REQUIRE:
        pytest.fail(f"required test data missing: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from mlx_flash.default_model import default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as e:
        _missing(str(e))


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory, default_gguf) -> str:
    """The default model converted with default options (the source's bytes: bundles of 32-neuron blocks)."""
    from mlx_flash.convert import convert

    return convert(default_gguf, str(tmp_path_factory.mktemp("stores") / "smollm2-source"), progress=False)


@pytest.fixture(scope="session")
def f16_store_dir(tmp_path_factory, default_gguf) -> str:
    """The default model with float16 FFN bundles (lossless w.r.t. the GGUF up to fp16 rounding)."""
    from mlx_flash.convert import convert

    return convert(
        default_gguf, str(tmp_path_factory.mktemp("stores") / "smollm2-f16"), precision="f16", progress=False
    )


@pytest.fixture(scope="session")
def engines():
    """load() memoized per (store, backend, ffn, torch_dtype): loading costs seconds."""
    import mlx_flash

    cache = {}

    def get(store, backend="torch", ffn="resident", torch_dtype="float32"):
        key = (store, backend, ffn, torch_dtype)
        if key not in cache:
            cache[key] = mlx_flash.load(store, backend=backend, ffn=ffn, torch_dtype=torch_dtype)
        return cache[key]

    yield get
    for e in cache.values():
        e.close()


@pytest.fixture(scope="session")
def wiki_text() -> str:
    from mlx_flash.calibrate.corpora import corpus_path

    try:
        with open(corpus_path("wikipedia"), encoding="utf-8") as fh:
            return fh.read()
    except ModelNotFoundError as e:
        _missing(str(e))


@pytest.fixture(scope="session")
def hf_reference(default_gguf):
    """transformers' own GGUF loader and Llama implementation: an independent reference."""
    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf)
    ).eval()
    return model


@pytest.fixture
def tiny_store(tmp_path):
    """Factory: tiny random HF model of a family converted into a store -> (store dir, HF model)."""
    import tiny_models

    from mlx_flash.convert import convert

    def make(family="llama", precision="source", dtype="float32", **over):
        hf = tiny_models.build(family, str(tmp_path / f"{family}-hf"), dtype=dtype, **over)
        store = convert(
            str(tmp_path / f"{family}-hf"), str(tmp_path / f"{family}-{precision}"), precision=precision, progress=False
        )
        return store, hf

    return make


CALIBRATION_TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40


@pytest.fixture
def calibrated_q4(tmp_path):
    """A tiny Llama quantized to 4 bits (the layout the channel-major kernel takes), with thresholds."""
    import tiny_models

    import mlx_flash
    from mlx_flash.calibrate.thresholds import calibrate
    from mlx_flash.convert import convert
    from mlx_flash.sparse.thresholds import save_thresholds

    tiny_models.build("llama", str(tmp_path / "hf"), intermediate_size=128, hidden_size=64)
    tiny_models.quantize_dir(str(tmp_path / "hf"), str(tmp_path / "q4"))
    store = convert(str(tmp_path / "q4"), str(tmp_path / "store"), progress=False)
    with mlx_flash.load(store, backend="torch", ffn="resident", progress=False) as e:
        save_thresholds(e.store, calibrate(e, CALIBRATION_TEXT, tokens=256, context=64, progress=False))
    return store
