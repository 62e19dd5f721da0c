"""mlx-community style quantized checkpoints (affine weight/scales/biases + "quantization" in
config.json), including per-layer bit overrides that keep q/k/v from being fused."""

import numpy as np
import pytest

import mlx_flash
import tiny_models
from mlx_flash.convert import convert

torch = pytest.importorskip("torch")


# source keeps the checkpoint's bytes: float32 rounding only; f16 rounds every FFN weight to float16
@pytest.mark.parametrize("precision,tol", [("f16", 2e-2), ("source", 1e-4)])
def test_quantized_dir_with_mixed_bits(tmp_path, precision, tol):
    hf = tiny_models.build("llama", str(tmp_path / "hf"))
    exact = tiny_models.quantize_dir(
        str(tmp_path / "hf"), str(tmp_path / "q"), overrides={"model.layers.0.self_attn.v_proj": 8}
    )
    with torch.no_grad():  # the reference runs on exactly the dequantized values
        for name, p in hf.named_parameters():
            p.copy_(torch.from_numpy(np.array(exact[name])))
    ids = tiny_models.random_ids(32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    store = convert(str(tmp_path / "q"), str(tmp_path / "store"), precision=precision, progress=False)
    for backend in ("mlx", "torch"):
        with mlx_flash.load(store, backend=backend) as e:
            assert isinstance(e.weights["layers"][0]["qkv"], tuple)  # v is 8-bit: not fused
            assert not isinstance(e.weights["layers"][1]["qkv"], tuple)
            assert np.abs(e.logits(ids) - ref).max() < tol
