"""No copy between a read and a kernel: every address a product's kernel is handed for its weights
(resident tensors, streamed layers' slots, streamed FFN buffers, a neuron cache's rows) lies in memory
the reader wrote the store's bytes to, on both backends. MLX's primitives record the addresses they
receive (kernels/mlx/primitives.cpp); torch's operators are handed buffer + offset by
TorchMatrix, recorded at the call. Reads are recorded where they land: the reader pool's destinations
and the resident file's buffers."""

import numpy as np
import pytest

import mlx_flash
from mlx_flash.kernels import mlx_kernels
from mlx_flash.store.reader_pool import ReaderPool
from mlx_flash.store.store import Store

pytestmark = pytest.mark.slow

MODES = {
    "resident": dict(ffn="resident"),
    "stream": dict(ffn="stream"),
    "streamed layers": dict(weights_budget="40MB", context=128),
    "sparse": dict(
        ffn="sparse",
        weights_budget="200%",
        io=mlx_flash.IOOptions(mode="buffered"),
        flash=mlx_flash.FlashOptions(mode="window", predictor="statistical"),
    ),
}


class Written:
    """Byte ranges reads wrote into (recorded by wrapping the readers)."""

    def __init__(self, monkeypatch):
        self.ranges = []
        pool_submit, pool_rows, store_read = ReaderPool.submit, ReaderPool.submit_rows, Store._read
        written = self

        def submit(pool, ranges, priority=0):
            ranges = list(ranges)
            for _, _, n, dest in ranges:
                written.ranges.append((dest.ctypes.data, n))
            return pool_submit(pool, ranges, priority)

        def submit_rows(pool, f, offsets, lengths, dest, dest_offsets, priority=0, row_bytes=0):
            written.ranges.append((dest.ctypes.data, dest.nbytes))
            return pool_rows(pool, f, offsets, lengths, dest, dest_offsets, priority, row_bytes)

        def read(store, file, offset, nbytes, alloc=None):
            buf = store_read(store, file, offset, nbytes, alloc)
            written.ranges.append((buf.ctypes.data, nbytes))
            return buf

        monkeypatch.setattr(ReaderPool, "submit", submit)
        monkeypatch.setattr(ReaderPool, "submit_rows", submit_rows)
        monkeypatch.setattr(Store, "_read", read)

    def holds(self, address: int) -> bool:
        return any(start <= address < start + n for start, n in self.ranges)


def _decode(e, tokens=3):
    ids = e.tokenizer.encode("The history of the city begins in the year")
    caches = e.new_caches()
    token = int(np.argmax(e.prefill(ids, caches)))
    for _ in range(tokens):
        token = int(np.argmax(e.forward([token], caches)[-1]))


@pytest.mark.parametrize("mode", list(MODES))
def test_mlx_primitives_read_weights_where_they_were_read(store_dir, mode, monkeypatch):
    written = Written(monkeypatch)
    ext = mlx_kernels.extension()
    with mlx_flash.load(store_dir, backend="mlx", progress=False, **MODES[mode]) as e:
        ext.record_inputs(True)
        try:
            _decode(e)
            got = ext.recorded_inputs()
        finally:
            ext.record_inputs(False)
    products = [a for name, a in got if name in ("StoredMatmul", "GatedFFN")]
    assert len(products) >= 3 * 5 * e.args.num_hidden_layers, "every product of every layer was recorded"
    outside = [hex(a) for a in products if not written.holds(a)]
    assert not outside, f"{len(outside)} of {len(products)} products read weights away from where they were read"


@pytest.mark.parametrize("mode", list(MODES))
def test_torch_operators_read_weights_where_they_were_read(store_dir, mode, monkeypatch):
    torch_ops = pytest.importorskip("mlx_flash.kernels.torch_ops")
    written = Written(monkeypatch)
    handed = []
    call, sparse, ffn = torch_ops.TorchMatrix.__call__, torch_ops.TorchMatrix.sparse, torch_ops.TorchMatrix.gated_ffn

    def recording(tm, x):
        handed.append(tm.buffer.data_ptr() + tm.offsets[0])
        return call(tm, x)

    def recording_sparse(tm, x, ids, n):
        handed.append(tm.buffer.data_ptr() + tm.offsets[0])
        return sparse(tm, x, ids, n)

    def recording_ffn(x, gate, up, down, *sparse):
        handed.extend(tm.buffer.data_ptr() + tm.offsets[0] for tm in (gate, up, down) if tm is not None)
        return ffn(x, gate, up, down, *sparse)

    monkeypatch.setattr(torch_ops.TorchMatrix, "gated_ffn", staticmethod(recording_ffn))
    monkeypatch.setattr(torch_ops.TorchMatrix, "__call__", recording)
    monkeypatch.setattr(torch_ops.TorchMatrix, "sparse", recording_sparse)
    with mlx_flash.load(store_dir, backend="torch", progress=False, **MODES[mode]) as e:
        _decode(e)
    assert len(handed) >= 3 * 4 * e.args.num_hidden_layers
    outside = [hex(a) for a in handed if not written.holds(a)]
    assert not outside, f"{len(outside)} of {len(handed)} products read weights away from where they were read"
