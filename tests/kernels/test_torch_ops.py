"""The CPU kernels as torch operators (kernels/torch_ops.py over kernels/torch/ops.cpp): each equals
the numpy path of the same kernel or its plain-ops reference, weights are read where they lie (torch
memory, or numpy memory shared without a copy), bad tensors are refused in one line, and the fake
implementations pass torch's operator checks (what torch.compile traces with)."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mlx_flash.errors import KernelUnavailableError  # noqa: E402
from mlx_flash.kernels import torch_ops  # noqa: E402
from mlx_flash.kernels.attention_ref import attention_ref  # noqa: E402
from mlx_flash.kernels.blockmatmul import BlockMatrix  # noqa: E402
from mlx_flash.kernels.gguf_blocks_ref import dequantize  # noqa: E402
from mlx_flash.kernels.pointwise_ref import rms_norm_ref, rope_ref, silu_mul_ref  # noqa: E402
from mlx_flash.kernels.qmatmul import StoredMatrix  # noqa: E402

from kernel_vectors import lay_out, quantized, random_bytes  # noqa: E402


@pytest.fixture(scope="module")
def ops():
    return torch_ops.ops()


def _x(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("laid_out", [False, True])
def test_products_equal_the_numpy_path_bit_for_bit(ops, bits, laid_out):
    rng = np.random.default_rng(bits)
    _, words, scales, biases = quantized(rng, 96, 256, bits, 32)
    m = StoredMatrix(
        *(lay_out(words, scales, biases, bits, 32, 32, False) if laid_out else (words, scales, biases)), bits, 32
    )
    x = _x(rng, 2, 3, 256)
    y = torch_ops.TorchMatrix(m, 2)(torch.from_numpy(x))
    assert y.shape == (2, 3, 96)
    assert np.array_equal(y.numpy().reshape(6, -1), m(x.reshape(6, -1), 2))


def test_block_products_and_rows(ops):
    raw = random_bytes("Q4_K", 20, 512, seed=1)
    m = BlockMatrix(raw, "Q4_K")
    tm = torch_ops.TorchMatrix(m, 2)
    x = _x(np.random.default_rng(0), 1, 512)
    assert np.array_equal(tm(torch.from_numpy(x)).numpy(), m(x, 2))
    assert np.array_equal(tm.rows(torch.tensor([[4, 19]])).numpy()[0], dequantize(raw[[4, 19]], "Q4_K"))


def test_weights_in_torch_memory_are_read_where_they_lie(ops):
    rng = np.random.default_rng(2)
    _, words, scales, biases = quantized(rng, 64, 128, 4, 32)
    buf = torch_ops.framework_buffer(words.nbytes + scales.nbytes + biases.nbytes)
    assert buf.ctypes.data % 4096 == 0
    w = buf[: words.nbytes].view(np.uint32).reshape(words.shape)
    s = buf[words.nbytes : words.nbytes + scales.nbytes].view(np.float16).reshape(scales.shape)
    b = buf[words.nbytes + scales.nbytes :].view(np.float16).reshape(biases.shape)
    w[...], s[...], b[...] = words, scales, biases
    tm = torch_ops.TorchMatrix(StoredMatrix(w, s, b, 4, 32), 1)
    assert tm.buffer.data_ptr() + tm.offsets[0] == w.ctypes.data


def test_attention_equals_the_reference(ops):
    rng = np.random.default_rng(3)
    q, k, v = _x(rng, 1, 9, 7, 64), _x(rng, 1, 3, 30, 64), _x(rng, 1, 3, 30, 64)
    y = ops.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), 0.125, 2)
    assert np.abs(y.numpy() - attention_ref(q, k, v, 0.125)).max() < 2e-5
    assert y.transpose(1, 2).is_contiguous(), "laid out for the output projection"


def test_attention_with_a_window_equals_the_reference(ops):
    rng = np.random.default_rng(5)
    q, k, v = _x(rng, 1, 8, 70, 64), _x(rng, 1, 2, 600, 64), _x(rng, 1, 2, 600, 64)
    y = ops.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), 0.125, 2, window=512)
    assert np.abs(y.numpy() - attention_ref(q, k, v, 0.125, window=512)).max() < 2e-5


def test_pointwise_operators_equal_their_references(ops):
    rng = np.random.default_rng(4)
    x, w = _x(rng, 3, 576), _x(rng, 576)
    assert (
        np.abs(ops.rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-5).numpy() - rms_norm_ref(x, w, 1e-5)).max()
        < 1e-5
    )
    g, u = _x(rng, 4, 50), _x(rng, 4, 50)
    assert np.abs(ops.silu_mul(torch.from_numpy(g), torch.from_numpy(u)).numpy() - silu_mul_ref(g, u)).max() < 1e-5
    q = _x(rng, 2, 3, 4, 64)
    inv = (1.0 / 1e4 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    pos = np.array([0, 9], np.int32)
    got = ops.rope(torch.from_numpy(q), torch.from_numpy(inv), torch.from_numpy(pos), 64, False, 1.0).numpy()
    assert np.abs(got - rope_ref(q, inv, pos, 64, False, 1.0)).max() < 2e-4


def test_bad_tensors_are_refused_in_one_line(ops):
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="w must be \\[D\\]"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(RuntimeError, match="the weights lie past their buffer"):
        ops.stored_matmul(torch.ones(1, 64), torch.zeros(10, dtype=torch.uint8), 0, 100, 0, 0, 0, 4, 32, 8, True, [], 1)


def test_fake_implementations_pass_torchs_operator_checks(ops):
    rng = np.random.default_rng(5)
    q, k = torch.from_numpy(_x(rng, 1, 4, 3, 16)), torch.from_numpy(_x(rng, 1, 2, 5, 16))
    torch.library.opcheck(ops.attention.default, (q, k, k, 0.25, 1), test_utils=("test_faketensor",))
    torch.library.opcheck(
        ops.rms_norm.default, (torch.ones(2, 8), torch.ones(8), 1e-5), test_utils=("test_faketensor",)
    )
    torch.library.opcheck(ops.silu_mul.default, (torch.ones(2, 8), torch.ones(2, 8)), test_utils=("test_faketensor",))
    _, words, scales, biases = quantized(rng, 32, 64, 4, 32)
    tm = torch_ops.TorchMatrix(StoredMatrix(words, scales, biases, 4, 32), 1)
    w, s, b = tm.offsets
    torch.library.opcheck(
        ops.stored_matmul.default,
        (torch.ones(3, 64), tm.buffer, 0, w, s, b, 0, 4, 32, 32, True, [], 1),
        test_utils=("test_faketensor",),
    )


def test_a_failed_build_is_one_line_naming_it(monkeypatch, tmp_path):
    """No compiler (or a broken one): the operators' build fails at load with one line, not at the
    first token."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'mf_torch_ops': c++: command not found\nmore lines")

    monkeypatch.setattr(torch_ops, "_OPS", None)
    monkeypatch.setattr(torch_ops, "_build_root", lambda: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.raises(KernelUnavailableError) as e:
        torch_ops.ops()
    assert "\n" not in str(e.value) and "c++: command not found" in str(e.value)


def _recorded_children(monkeypatch):
    """The commands build_in_background would run, recorded instead of run."""
    children = []
    monkeypatch.setattr(torch_ops.subprocess, "run", lambda cmd, **kw: children.append(cmd))
    return children


def test_load_starts_the_build_ahead_only_when_it_is_missing(monkeypatch, tmp_path, capsys):
    """Unbuilt: one child is started, building into the same folder ops() loads from, and a line
    says so. Built: nothing is started and nothing said."""
    children = _recorded_children(monkeypatch)
    monkeypatch.setattr(torch_ops, "_build_root", lambda: str(tmp_path))
    torch_ops.build_in_background(progress=True)
    for t in [t for t in threading.enumerate() if t.name == "torch-ops-build"]:
        t.join(5)
    assert len(children) == 1 and f"build_ahead({str(tmp_path)!r})" in children[0][-1]
    assert "in the background" in capsys.readouterr().err
    where, _ = torch_ops.folder(str(tmp_path), torch_ops.SOURCES, torch_ops._salt(torch_ops._torch_version()))
    os.makedirs(where)
    open(os.path.join(where, "mf_torch_ops_x.so"), "w").close()
    torch_ops.build_in_background(progress=True)
    assert len(children) == 1 and capsys.readouterr().err == ""


def test_the_build_ahead_of_a_built_folder_returns_without_importing_torch(tmp_path):
    """The child that finds the operators built (another process built them first) leaves at once:
    importing torch alone takes seconds of a core."""
    where, _ = torch_ops.folder(str(tmp_path), torch_ops.SOURCES, torch_ops._salt(torch_ops._torch_version()))
    os.makedirs(where)
    open(f"{where}/mf_torch_ops_x.so", "w").close()
    code = (
        "import sys; from mlx_flash.kernels import torch_ops; "
        f"torch_ops.build_ahead({str(tmp_path)!r}); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("built_first", [False, True])
def test_a_waiter_says_so_only_while_a_build_is_under_way(tmp_path, capsys, built_first):
    """Another process holds the build's lock. Nothing built yet: a line says the build is under way,
    then the waiter takes what that process built. Built already (the holder only loads it): the wait
    is short and nothing is said."""
    import fcntl

    where, _ = torch_ops.folder(str(tmp_path), torch_ops.SOURCES, torch_ops._salt(torch_ops._torch_version()))
    os.makedirs(where)
    so = os.path.join(where, "mf_torch_ops_x.so")
    if built_first:
        open(so, "w").close()
    holder = open(os.path.join(where, ".lock"), "w")
    fcntl.flock(holder, fcntl.LOCK_EX)

    def finish():  # the holder's build ends: its library is there, then its lock is let go
        open(so, "w").close()
        holder.close()

    timer = threading.Timer(0.5, finish)
    timer.start()
    torch_ops.build_ahead(str(tmp_path))  # returns once the lock is free and the folder built
    timer.join()
    said = capsys.readouterr().err
    assert ("waiting for the build of" in said) is not built_first, said
