"""The small synthetic Qwen3-MoE GGUF the MoE tests share (tests/moe/conftest.py writes it once a
session): d_model 256, 4 experts of 256 neurons, top-2, 3 layers, in a GGUF quantization."""

from mlx_flash.calibrate import synthetic_gguf

D, FE, E = 256, 256, 4  # k-quant rows are whole super-blocks of 256


def write_moe_gguf(path: str, quant: str, tokenizer=None) -> str:
    """A 3-layer Qwen3-MoE of d_model 256, 4 experts of 256 neurons, top-2, in `quant`."""
    shape = dict(
        synthetic_gguf.SHAPES["qwen3-30b-a3b"],
        hidden_size=D,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=FE,
        intermediate_size=4 * FE,
    )
    saved = dict(synthetic_gguf.SHAPES)
    synthetic_gguf.SHAPES["small-moe"] = shape
    try:
        return synthetic_gguf.write_synthetic_gguf(
            path, "small-moe", quant, layers=3, progress=False, tokenizer=tokenizer
        )
    finally:
        synthetic_gguf.SHAPES.clear()
        synthetic_gguf.SHAPES.update(saved)
