"""The CUDA stored product (kernels/cuda_ops.py: torch's stored_matmul on CUDA tensors, over
cuda/qmatmul.cu) against the plain-ops reference qmatmul_ref: code widths, group sizes, scale types,
both orientations (rows are outputs: a linear; rows are inputs: a neuron-major down matrix), one
token and more than a launch takes, row counts that leave the last block of rows part empty; GGUF
block kinds refused by name. Those need an NVIDIA GPU and skip elsewhere with the reason. One test
runs everywhere: CudaMatrix's buffer layout and arguments, read through the CPU operator."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mlx_flash.errors import KernelUnavailableError  # noqa: E402
from mlx_flash.kernels import cuda_ops, torch_ops  # noqa: E402
from mlx_flash.kernels.qmatmul import StoredMatrix  # noqa: E402
from mlx_flash.kernels.qmatmul_ref import qmatmul_ref  # noqa: E402
from mlx_flash.quant_spec import BLOCKS  # noqa: E402

from kernel_vectors import quantized  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is false)")


def bf16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 values -> (bfloat16 words as uint16, truncated; the float32 values they hold)."""
    words = (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return words, (words.astype(np.uint32) << 16).view(np.float32)


def stored(rng, rows, codes, bits, group, scale, rows_are_outputs):
    """(a StoredMatrix, its words, scale and bias values as floats) of random codes."""
    dtype = np.float16 if scale == "float16" else np.float32
    _, words, scales, biases = quantized(rng, rows, codes, bits, group, dtype)
    if scale == "bfloat16":
        (scales, s_vals), (biases, b_vals) = bf16(scales), bf16(biases)
    else:
        s_vals, b_vals = scales, biases
    m = StoredMatrix(words, scales, biases, bits, group, rows_are_outputs, scale == "bfloat16")
    return m, words, s_vals, b_vals


def check(y, ref):
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert y.shape == ref.shape and err < 1e-5, f"relative error {err:.1e}"


@gpu
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("rows_are_outputs", [True, False])
def test_cuda_product_equals_reference(bits, group, scale, rows_are_outputs):
    rng = np.random.default_rng(bits * 1000 + group + len(scale) + rows_are_outputs)
    # 1003 output rows: 125 blocks of 8 rows and 3 more; 11 input rows: fewer than the K chunks
    rows, codes = (1003, 384) if rows_are_outputs else (389, 640)
    for rows_now in (rows,) if rows_are_outputs else (rows, 11):
        m, words, s, b = stored(rng, rows_now, codes, bits, group, scale, rows_are_outputs)
        cm = cuda_ops.CudaMatrix(m, "cuda")
        for T in (1, 5, 8, 19):  # 19: three launches
            x = rng.standard_normal((T, m.k_in)).astype(np.float32)
            y = cm(torch.from_numpy(x).cuda()).cpu().numpy()
            check(y, qmatmul_ref(x, words, s, b, bits, group, rows_are_outputs))


@gpu
def test_leading_axes_and_a_strided_input():
    rng = np.random.default_rng(3)
    m, words, s, b = stored(rng, 70, 256, 4, 64, "float16", True)
    cm = cuda_ops.CudaMatrix(m, "cuda")
    x = rng.standard_normal((2, 3, 512)).astype(np.float32)
    y = cm(torch.from_numpy(x).cuda()[..., ::2]).cpu().numpy()
    check(y.reshape(6, 70), qmatmul_ref(x[..., ::2].reshape(6, 256), words, s, b, 4, 64))


@gpu
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_x_off_16_bytes_takes_the_one_word_loads(bits):
    """x starting 4 bytes past a 16-byte boundary (a view into a longer buffer) cannot be read as
    float4s: the one-word kernel runs and gives the reference's product too."""
    rng = np.random.default_rng(7)
    m, words, s, b = stored(rng, 70, 256, bits, 32, "float16", True)
    cm = cuda_ops.CudaMatrix(m, "cuda")
    x = rng.standard_normal((3, 256)).astype(np.float32)
    flat = torch.zeros(3 * 256 + 1, device="cuda")
    flat[1:] = torch.from_numpy(x.reshape(-1)).cuda()
    shifted = flat[1:].view(3, 256)
    assert shifted.data_ptr() % 16 == 4
    check(cm(shifted).cpu().numpy(), qmatmul_ref(x, words, s, b, bits, 32))
    check(cm(torch.from_numpy(x).cuda()).cpu().numpy(), qmatmul_ref(x, words, s, b, bits, 32))


@gpu
def test_fake_implementation_fits():
    rng = np.random.default_rng(4)
    cm = cuda_ops.CudaMatrix(stored(rng, 32, 64, 4, 32, "float16", True)[0], "cuda")
    w, s, b = cm.offsets
    torch.library.opcheck(
        cuda_ops.ops().stored_matmul.default,
        (torch.ones(3, 64, device="cuda"), cm.buffer, 0, w, s, b, 0, 4, 32, 32, True, [], 1),
        test_utils=("test_faketensor",),
    )


@gpu
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_kinds_are_refused_by_name(name):
    x, buf = torch.zeros((1, 256), device="cuda"), torch.zeros(4096, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match=f"{name} has no CUDA kernel"):
        cuda_ops.ops().stored_matmul(x, buf, BLOCKS[name].ggml_type, 0, 0, 0, 0, 0, 0, 8, True, [], 1)


@gpu
def test_a_buffer_too_short_is_refused():
    rng = np.random.default_rng(5)
    cm = cuda_ops.CudaMatrix(stored(rng, 32, 64, 4, 32, "float16", True)[0], "cuda")
    w, s, b = cm.offsets
    with pytest.raises(RuntimeError, match="lie past their buffer"):
        cm.ops.stored_matmul(torch.ones(1, 64, device="cuda"), cm.buffer[:b], 0, w, s, b, 0, 4, 32, 32, True, [], 1)


@pytest.mark.parametrize("scale", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("rows_are_outputs", [True, False])
def test_device_buffer_layout_through_the_cpu_operator(monkeypatch, scale, rows_are_outputs):
    """CudaMatrix on the CPU (the same operator's CPU kernel): its buffer, offsets and arguments give
    the reference product, and parts() views the stored values."""
    monkeypatch.setattr(cuda_ops, "ops", torch_ops.ops)
    rng = np.random.default_rng(6)
    m, words, s, b = stored(rng, 40, 128, 4, 32, scale, rows_are_outputs)
    cm = cuda_ops.CudaMatrix(m, "cpu")
    x = rng.standard_normal((3, m.k_in)).astype(np.float32)
    check(cm(torch.from_numpy(x)).numpy(), qmatmul_ref(x, words, s, b, 4, 32, rows_are_outputs))
    w, sc, bi = cm.parts()
    assert np.array_equal(w.numpy().view(np.uint32), words)
    assert np.array_equal(sc.float().numpy(), s.astype(np.float32))
    assert np.array_equal(bi.float().numpy(), b.astype(np.float32))


def test_without_a_gpu_nothing_is_built(monkeypatch):
    monkeypatch.setattr(cuda_ops, "_LOADED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KernelUnavailableError, match="no NVIDIA GPU") as e:
        cuda_ops.ops()
    assert "\n" not in str(e.value)
