"""models.MODEL_TYPES, the one table of supported model_types: every entry names a module that has
the graph protocol, the error for an unknown type lists the table, and the per-type differences the
table no longer has modules for (moefied_llama's unit router weights, qwen3moe's GGUF name) hold."""

import pytest

from mlx_flash.errors import UnsupportedModelError
from mlx_flash.models import (
    GGUF_MOE_ARCHS,
    MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    gguf_model_type,
    model_entry,
    model_module,
)
from mlx_flash.models.common import GGUFLayout

PROTOCOL = (
    "normalize_config",
    "canonical_tensors",
    "ffn_parts",
    "ModelArgs",
    "build",
    "embed",
    "block",
    "head",
    "forward",
)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_each_type_finds_a_module_with_the_graph_protocol(model_type):
    mod = model_module(model_type, "t")
    assert mod.__name__ == f"mlx_flash.models.{MODEL_TYPES[model_type].module}"
    assert all(callable(getattr(mod, name)) for name in PROTOCOL)
    assert isinstance(mod.GGUF, GGUFLayout)


def test_an_unknown_type_is_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match=r"t: model_type 'bert' is not supported \(supported: llama, "):
        model_module("bert", "t")
    assert model_entry("qwen3-moe", "t") is MODEL_TYPES["qwen3_moe"]  # "-" is read as "_", as HF configs vary


def test_gguf_architecture_names_map_to_model_types():
    assert gguf_model_type("qwen3moe") == "qwen3_moe" and gguf_model_type("llama") == "llama"
    assert GGUF_MOE_ARCHS == ("qwen3moe",)


def test_moefied_llama_adds_its_experts_unweighted_and_other_moes_do_not():
    hf = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 100,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    moefied = model_module("moefied_llama", "t").normalize_config({**hf, "model_type": "moefied_llama"}, "t")
    qwen = model_module("qwen3_moe", "t").normalize_config({**hf, "model_type": "qwen3_moe"}, "t")
    assert moefied["unit_router_weights"] is True and "unit_router_weights" not in qwen
