"""CPU quantized matmul: milliseconds and GB/s of stored weight bytes per shape, bits, token count
and thread count, against float32 numpy on a dequantized copy (what a float copy costs), MLX's CPU
quantized_matmul on the same bytes, and this machine's memory bandwidth (numpy copy of 512 MB).
With --cuda, the CUDA stored product (kernels/cuda/qmatmul.cu) on an NVIDIA GPU instead, against a
device-to-device copy of the same bytes.

    python -m mlx_flash.bench matmul [--tokens 1,16] [--threads 1,2] [--cuda] [--out FILE.json]

Shapes: the default model's decode linears (576/1536, SmolLM2-135M) and a 7B-class FFN (4096/14336).
Timings are medians of --repeat calls after a warm-up; the machine's other load shows in them.
"""

import argparse
import os
import statistics
import sys

import numpy as np

from mlx_flash.errors import KernelUnavailableError, first_paragraph
from mlx_flash.bench.timing import median_seconds
from mlx_flash.kernels.qmatmul import cpu_isa, qmatmul
from mlx_flash.kernels.qmatmul_ref import dequantize
from mlx_flash.kernels import cuda_ops
from mlx_flash.kernels.qmatmul import StoredMatrix
from mlx_flash.durable import write_json
from mlx_flash.store.atomic_dir import OutputError

# (name, outputs N, inputs K, transposed): transposed=False is the neuron-major down projection.
SHAPES = [
    ("135M gate_up", 3072, 576, True),
    ("135M down (neuron-major)", 576, 1536, False),
    ("7B up", 14336, 4096, True),
    ("7B down", 4096, 14336, True),
]


def median_ms(fn, repeat: int) -> float:
    return median_seconds(fn, repeat) * 1e3


def memory_bandwidth_gbs(repeat: int = 5) -> float:
    """Read + write GB/s of a 512 MB numpy copy (one thread; the ceiling a memory-bound kernel meets)."""
    src = np.ones(128 << 20, dtype=np.float32)
    dst = np.empty_like(src)
    ms = median_ms(lambda: np.copyto(dst, src), repeat)
    return 2 * src.nbytes / ms / 1e6


def cuda_ms(fn, repeat: int) -> float:
    """Median milliseconds of `fn` on the current CUDA stream (CUDA events around `repeat` calls, 5 times)."""
    import torch

    fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(repeat):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / repeat)
    return statistics.median(times)


def bench_cuda(a, tokens) -> list[dict]:
    """The CUDA stored product per shape, bits and token count; its GB/s of stored bytes against a
    device-to-device copy of as many bytes (read + write)."""
    import torch

    cuda_ops.ops()  # built before timing (once per torch version and GPU)
    print(f"CUDA: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    rng, rows = np.random.default_rng(0), []
    for bits in [int(b) for b in a.bits.split(",")]:
        for name, n_out, k_in, transposed in SHAPES:
            w, s, b = packed(rng, *((n_out, k_in) if transposed else (k_in, n_out)), bits)
            cm = cuda_ops.CudaMatrix(StoredMatrix(w, s, b, bits, 32, transposed, False), "cuda")
            stored = w.nbytes + s.nbytes + b.nbytes
            src = torch.empty(stored, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_gbs = 2 * stored / cuda_ms(lambda: dst.copy_(src), a.repeat) / 1e6
            for t in tokens:
                x = torch.randn(t, k_in, device="cuda")
                ms = cuda_ms(lambda: cm(x), a.repeat)
                row = {"shape": name, "N": n_out, "K": k_in, "bits": bits, "T": t, "stored_MB": stored / 1e6}
                row.update(cuda_ms=ms, cuda_GBs=stored / ms / 1e6, copy_GBs=copy_gbs)
                rows.append(row)
                print(
                    f"q{bits} {name:26s} T={t:<3d} {stored / 1e6:7.2f} MB | {ms * 1e3:8.1f} us "
                    f"{row['cuda_GBs']:7.0f} GB/s | copy {copy_gbs:5.0f} GB/s (read + write) "
                    f"| {row['cuda_GBs'] / copy_gbs:4.0%} of it",
                    flush=True,
                )
    return rows


def packed(rng, rows: int, cols: int, bits: int, group: int = 32):
    per = 32 // bits
    words = rng.integers(0, 2**32, size=(rows, cols // per), dtype=np.uint32)
    scales = (rng.standard_normal((rows, cols // group)) * 0.01).astype(np.float16)
    biases = (rng.standard_normal((rows, cols // group)) * 0.05).astype(np.float16)
    return words, scales, biases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_flash.bench matmul", description=first_paragraph(__doc__))
    p.add_argument("--tokens", default="1,16", help="token counts T (comma-separated; default 1,16)")
    p.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    p.add_argument("--bits", default="4,8", help="bit widths (default 4,8)")
    p.add_argument("--repeat", type=int, default=20, help="timed calls per cell (default 20)")
    p.add_argument("--no-mlx", action="store_true", help="skip MLX's quantized_matmul (slow on a CPU)")
    p.add_argument("--cuda", action="store_true", help="the CUDA stored product on an NVIDIA GPU instead")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.cuda:
        try:
            rows = bench_cuda(a, tokens)
        except KernelUnavailableError as e:
            print(f"bench_kernel: {e}", file=sys.stderr)
            return 2
        if a.out:
            write_json(a.out, {"target": "cuda", "rows": rows}, OutputError, indent=1)
        return 0
    threads = [int(t) for t in a.threads.split(",")]
    rng = np.random.default_rng(0)
    bw = memory_bandwidth_gbs()
    print(
        f"CPU path: {cpu_isa().name}; cores: {os.cpu_count()}; memory bandwidth (numpy copy, 1 thread): {bw:.1f} GB/s"
    )
    rows = []
    for bits in [int(b) for b in a.bits.split(",")]:
        for name, n_out, k_in, transposed in SHAPES:
            w, s, b = packed(rng, *((n_out, k_in) if transposed else (k_in, n_out)), bits)
            stored = w.nbytes + s.nbytes + b.nbytes
            dense = dequantize(w, s, b, bits, 32).astype(np.float32)
            dense = np.ascontiguousarray(dense.T) if transposed else dense  # [K, N] for x @ dense
            for t in tokens:
                x = rng.standard_normal((t, k_in)).astype(np.float32)
                row = {"shape": name, "N": n_out, "K": k_in, "bits": bits, "T": t, "stored_MB": stored / 1e6}
                for th in threads:
                    ms = median_ms(lambda: qmatmul(x, w, s, b, bits, 32, transposed, threads=th), a.repeat)
                    row[f"ours_{th}t_ms"], row[f"ours_{th}t_GBs"] = ms, stored / ms / 1e6
                row["numpy_f32_ms"] = median_ms(lambda: x @ dense, max(3, a.repeat // 4))
                if not a.no_mlx:
                    import mlx.core as mx

                    xm, wm, sm, bm = mx.array(x), mx.array(w), mx.array(s), mx.array(b)
                    row["mlx_qmm_ms"] = median_ms(
                        lambda: mx.eval(
                            mx.quantized_matmul(xm, wm, sm, bm, transpose=transposed, group_size=32, bits=bits)
                        ),
                        max(3, a.repeat // 4),
                    )
                rows.append(row)
                cells = " | ".join(
                    f"{th}t {row[f'ours_{th}t_ms']:.3f} ms {row[f'ours_{th}t_GBs']:.1f} GB/s" for th in threads
                )
                extra = f" | numpy f32 {row['numpy_f32_ms']:.3f} ms"
                if "mlx_qmm_ms" in row:
                    extra += f" | mlx qmm {row['mlx_qmm_ms']:.3f} ms"
                print(f"q{bits} {name:26s} T={t:<3d} {stored / 1e6:7.2f} MB | {cells}{extra}", flush=True)
    if a.out:
        write_json(a.out, {"cpu_path": cpu_isa().name, "memory_bandwidth_GBs": bw, "rows": rows}, OutputError, indent=1)
    return 0
