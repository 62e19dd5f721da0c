"""A MoE GGUF whose experts are k-quants (llama.cpp's Q4_K_M mix on a small Qwen3-MoE shape: Q4_K
experts, Q6_K down stacks in its more-bits layers) keeps every expert's bytes as the file has them:
an expert slot is the expert's whole super-blocks, read and multiplied by the block kernel in place.
Resident and streamed experts (fewer slots than experts) answer alike bit for bit on both backends,
and both stay within float16 rounding of a store whose experts were dequantized to floats."""

import numpy as np
import pytest

import mlx_flash
from greedy import greedy
from mlx_flash.convert import convert
from mlx_flash.store import open_store
from moe_files import E, FE

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")


PROMPT = list(range(5, 25))


def test_an_expert_slot_is_the_experts_bytes_as_stored(moe_gguf, moe_store):
    lay = open_store(moe_store, False, False).manifest.ffn
    assert lay.n_experts == E and lay.block == FE and lay.quant["gate"].kind == "Q4_K"
    assert [lq["down"].kind for lq in lay.layer_quant] == ["Q4_K", "Q4_K", "Q6_K"]  # the mix's more-bits layer
    reader = gguf.GGUFReader(moe_gguf)
    stack = next(t for t in reader.tensors if t.name == "blk.1.ffn_gate_exps.weight")
    raw = np.asarray(stack.data).reshape(-1).view(np.uint8)
    per = raw.size // E
    with open(open_store(moe_store, False, False).file_path(lay.file), "rb") as fh:
        fh.seek(lay.expert_offset(1, 2))
        slot = np.frombuffer(fh.read(lay.expert_size(1, 2)), np.uint8)
    assert raw[2 * per : 3 * per].tobytes() in slot.tobytes()  # expert 2's gate rows, byte for byte


# torch in the full tier (~6 s): tests/moe/test_moe_models.py streams experts on both backends
@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.full), "mlx"])
def test_streamed_block_experts_equal_resident_and_the_dequantized_model(moe_gguf, moe_store, tmp_path, backend):
    with mlx_flash.load(moe_store, backend=backend, ffn="resident", progress=False) as e:
        want = greedy(e, PROMPT, 6)
    with mlx_flash.load(moe_store, backend=backend, ffn="stream", weights_budget="97%", progress=False) as e:
        got = greedy(e, PROMPT, 6)
        st = e.ffn.stats()
        assert 0 < st.expert_slots < 3 * E and sum(miss for _, miss in st.expert_hits) > 0  # read as routed
    assert got[0] == want[0] and np.array_equal(got[1], want[1])
    floats = convert(moe_gguf, str(tmp_path / "f16"), precision="f16", progress=False)
    with mlx_flash.load(floats, backend=backend, ffn="resident", progress=False) as e:
        ref = greedy(e, PROMPT, 6)[1]
    assert np.abs(want[1] - ref).max() < 1e-2 * np.abs(ref).max()
