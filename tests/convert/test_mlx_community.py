"""mlx-community style quantized checkpoints (affine weight/scales/biases + "quantization" in
config.json), including per-layer bit overrides that keep q/k/v from being fused."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest

import mlx_flash
import tiny_models
from mlx_flash.convert import convert

torch = pytest.importorskip("torch")


def quantize_dir(hf_dir, out_dir, bits=4, group=32, overrides=None):
    """Quantize every 2-D linear the way mlx-lm does; returns the dequantized tensors (the exact
    values the quantized checkpoint stands for)."""
    overrides = overrides or {}
    tensors = mx.load(os.path.join(hf_dir, "model.safetensors"))
    out, exact = {}, {}
    for name, w in tensors.items():
        base = name[: -len(".weight")]
        if name.endswith(".weight") and w.ndim == 2:
            b = overrides.get(base, bits)
            q, s, z = mx.quantize(w.astype(mx.float16), group_size=group, bits=b)
            out.update({f"{base}.weight": q, f"{base}.scales": s, f"{base}.biases": z})
            exact[name] = mx.dequantize(q, s, z, group_size=group, bits=b).astype(mx.float32)
        else:
            out[name] = w
            exact[name] = w
    os.makedirs(out_dir, exist_ok=True)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), out)
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    cfg["quantization"] = {"group_size": group, "bits": bits,
                           **{k: {"group_size": group, "bits": v} for k, v in overrides.items()}}
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"))
    tiny_models.write_tokenizer(out_dir)
    return exact


@pytest.mark.parametrize("precision,tol", [("f16", 2e-2), ("source", 5e-2)])
def test_quantized_dir_with_mixed_bits(tmp_path, precision, tol):
    hf = tiny_models.build("llama", str(tmp_path / "hf"))
    exact = quantize_dir(str(tmp_path / "hf"), str(tmp_path / "q"),
                         overrides={"model.layers.0.self_attn.v_proj": 8})
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
