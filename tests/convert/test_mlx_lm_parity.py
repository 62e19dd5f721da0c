"""mlx-lm as the reference on MLX: the default model, written as a Hugging Face folder from
transformers' GGUF loader and quantized by `mlx_lm.convert` into an mlx-community-style folder, is
loaded by us on MLX and decodes the same 32 greedy tokens as `mlx_lm.stream_generate` on two
prompts (five in the full tier). Skipped only where mlx-lm, transformers or torch are missing, and
that is a failure in CI (MLX_FLASH_REQUIRE_DATA=1), whose dev install has them."""

import json
import os

import pytest

from conftest import _missing

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The theory of relativity",
    "Water boils at",
]
# The default tier decodes the first two (prose and code, ~35 s of a two-core run); the full tier all five.
PROMPTS = PROMPTS if os.environ.get("MLX_FLASH_FULL") == "1" else PROMPTS[:2]
TOKENS = 32
pytestmark = pytest.mark.slow


def _need(module: str):
    try:
        return __import__(module)
    except ImportError:
        _missing(f"{module} is not installed (the dev extra has it)")


def write_hf_folder(gguf: str, out: str) -> None:
    """The GGUF as a Hugging Face folder, through transformers' loader (its weights dequantized to
    float32). transformers marks a GGUF-loaded model unserializable, so the config and weights are
    written from it here; `rope_theta` also at the top level, where mlx-lm reads it (transformers 5
    keeps it under rope_parameters only, and mlx-lm then takes 10,000 for SmolLM2's 100,000)."""
    transformers = _need("transformers")
    _need("torch")
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    os.makedirs(out)
    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    tok.save_pretrained(out)


@pytest.fixture(scope="module")
def mlx_community_folder(default_gguf, tmp_path_factory):
    mlx_lm = _need("mlx_lm")
    base = tmp_path_factory.mktemp("mlx-lm")
    write_hf_folder(default_gguf, str(base / "hf"))
    mlx_lm.convert(str(base / "hf"), str(base / "q4"), quantize=True, q_group_size=32, q_bits=4)
    return str(base / "q4")


def test_greedy_tokens_equal_mlx_lm(mlx_community_folder, tmp_path):
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from mlx_flash import load

    with open(os.path.join(mlx_community_folder, "config.json")) as f:
        assert json.load(f)["quantization"]["bits"] == 4  # (a quantized folder, as mlx-community's)
    model, tokenizer = mlx_lm.load(mlx_community_folder)
    ours = load(mlx_community_folder, backend="mlx", cache_dir=str(tmp_path), progress=False)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert ours.tokenizer.encode(prompt) == ids
        want = [
            r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=TOKENS, sampler=make_sampler(0.0))
        ]
        got = [s.token for s in ours.stream_generate(prompt, max_tokens=TOKENS)]
        assert got == want, prompt
