"""Options are typed values checked once: strings become enums, bad values are named, and the
chat's flags are generated from the documented fields (every one of them, round-tripping)."""

import dataclasses

import pytest

from mlx_flash.cli.chat import parse_args
from mlx_flash.config import Backend, EngineConfig, FFNMode
from mlx_flash.errors import ConfigError
from mlx_flash.moe.policies import ExpertPolicy
from mlx_flash.options import ExpertOptions, FlashOptions, IOOptions, ReadMode, from_arguments
from mlx_flash.sparse.modes import SparseMode
from mlx_flash.sparse.selectors import PredictorKind


def test_strings_become_enums_once():
    f = FlashOptions(mode="window", predictor="gate", down_only=True)
    assert f.mode is SparseMode.WINDOW and f.predictor is PredictorKind.GATE
    assert ExpertOptions(policy="lru").policy is ExpertPolicy.LRU
    assert IOOptions(mode="buffered").mode is ReadMode.BUFFERED
    cfg = EngineConfig(backend="torch", ffn="sparse", flash=f)
    assert cfg.backend is Backend.TORCH and cfg.ffn is FFNMode.SPARSE and cfg.flash is f


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: FlashOptions(mode="most"), "sparse_mode 'most' is unknown"),
        (lambda: FlashOptions(predictor="oracle"), "predictor 'oracle' is unknown"),
        (lambda: FlashOptions(window=-1), "window must be"),
        (lambda: FlashOptions(recall=1.5), "recall must be"),
        (lambda: FlashOptions(down_only=True), "down-only reads need"),
        (lambda: ExpertOptions(policy="mru"), "expert_policy 'mru' is unknown"),
        (lambda: ExpertOptions(preload=-2), "preload must be"),
        (lambda: IOOptions(threads=0), "io threads must be"),
        (lambda: EngineConfig(ffn="cached"), "ffn 'cached' is unknown"),
        (lambda: EngineConfig(backend="jax"), "backend 'jax' is unknown"),
        (lambda: EngineConfig(flash={"mode": "all"}), "flash must be a mlx_flash.FlashOptions"),
        (lambda: EngineConfig(prefill_chunk=0), "prefill_chunk must be"),
    ],
)
def test_bad_values_are_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_every_documented_option_is_a_chat_flag():
    assert from_arguments(EngineConfig, parse_args([])) == EngineConfig()
    cfg = from_arguments(
        EngineConfig,
        parse_args(
            [
                "--backend",
                "torch",
                "--ffn",
                "sparse",
                "--memory-budget",
                "300MB",
                "--sparse-mode",
                "window",
                "--window",
                "3",
                "--predictor",
                "gate",
                "--predictor-recall",
                "0.9",
                "--down-only",
                "--expert-policy",
                "lfu",
                "--expert-preload",
                "2",
                "--io-mode",
                "buffered",
                "--io-threads",
                "4",
                "--torch-dtype",
                "bfloat16",
                "--threads",
                "2",
                "--prefill-chunk",
                "64",
                "--verify",
            ]
        ),
    )
    assert cfg.flash == FlashOptions(mode="window", window=3, predictor="gate", recall=0.9, down_only=True)
    assert cfg.experts == ExpertOptions(policy="lfu", preload=2) and cfg.io == IOOptions(mode="buffered", threads=4)
    assert (cfg.memory_budget, cfg.threads, cfg.prefill_chunk, cfg.verify_checksums) == ("300MB", 2, 64, True)
    documented = [
        f
        for cls in (EngineConfig, FlashOptions, ExpertOptions, IOOptions)
        for f in dataclasses.fields(cls)
        if not dataclasses.is_dataclass(f.metadata.get("kind"))
    ]
    assert all(f.metadata["help"] for f in documented)


@pytest.mark.parametrize(
    "kw,precision",
    [
        ({}, "source"),  # resident: the lossless store
        ({"ffn": "stream"}, "source"),
        ({"ffn": "sparse", "flash": FlashOptions(predictor="dense")}, "source"),  # exact sparse modes
        ({"ffn": "sparse", "flash": FlashOptions(mode="naive", predictor="gate")}, "source"),  # reads whole layers
        ({"ffn": "sparse"}, "source-neuron"),  # the low-rank predictor selects neurons approximately
        ({"ffn": "sparse", "flash": FlashOptions(predictor="gate")}, "source-neuron"),
        ({"ffn": "sparse", "precision": "f16"}, "f16"),  # named: kept
    ],
)
def test_auto_precision(kw, precision):
    """precision="auto" converts a source losslessly unless a sparse FFN selects neurons approximately,
    where per-neuron bundles read far less for the same quality (python -m mlx_flash.bench read-unit)."""
    assert EngineConfig(**kw).store_precision() == precision


def test_unknown_precision_is_named():
    with pytest.raises(ConfigError, match="precision 'q5' is unknown"):
        EngineConfig(precision="q5")
