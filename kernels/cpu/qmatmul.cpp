// Fused quantized matmul on the CPU: float32 activations times affine group-quantized weights in the
// store's layout (MLX's: w = q * scale + bias, `bits` 2, 4 or 8 (2 on the portable path only),
// groups of `group` along the packed axis, codes packed little-endian into uint32 words), float32
// accumulation, no dequantized copy of a weight.
//
//   transposed = 1:  y[T, N] = x[T, K] @ W^T,  W stored [N, K/pack] (rows are outputs; the usual linear)
//   transposed = 0:  y[T, N] = x[T, K] @ W,    W stored [K, N/pack] (rows are inputs; neuron-major down)
//
// Per group the dot product splits as  s * sum(q * x) + b * sum(x),  so codes are only widened to
// float and multiplied, never scaled per element. Three instruction sets picked at run time from what
// the CPU reports (qmatmul_avx512.cpp, qmatmul_avx2.cpp, qmatmul_portable.cpp); the x86 paths are
// compiled with function-level target attributes, so the library itself needs no -m flags and runs anywhere.
// Threads come from a small persistent pool (output columns are split between them); the plain-ops
// reference is kernels/qmatmul_ref.py (mlx_flash.kernels.qmatmul_ref) and tests/kernels/test_qmatmul.py
// compares the two on every path this CPU can run.

// Python.h: the module's one function, qmatmul, is the per-call entry (METH_FASTCALL, buffers checked
// here, the GIL released while computing): a ctypes call costs ~10-20 us of marshalling, and a decode
// step makes ~120 of them. The rarely called mf_* functions below are reached through ctypes.
#include <Python.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#include "gguf_blocks.h"
#include "q8.h"
#include "qmatmul.h"

#if MF_X86
#include <cpuid.h>
#endif

using namespace mf;

namespace {

// ---- instruction set ------------------------------------------------------------------------------
// Levels (mf_cpu_isa): 0 portable, 1 AVX2 (+FMA, F16C), 2 AVX-512 F + BW, 3 AVX-VNNI (AVX2 with 256-bit
// VNNI), 4 AVX-512 VNNI. The float arithmetic has three paths (0, 1, 2: a VNNI level runs its width's
// float path); the q8 arithmetic one per level (q8_matmul.cpp).
enum Isa { GENERIC = 0, AVX2 = 1, AVX512 = 2, AVXVNNI = 3, AVX512VNNI = 4 };

bool has_avx2() {
#if MF_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool has_avx512() {
#if MF_X86
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

bool has_avx512vnni() {
#if MF_X86
  return has_avx512() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool has_avxvnni() {  // the VEX encoding (CPUID 7.1 EAX bit 4), which GCC 12's builtin does not name
#if MF_X86
  unsigned a, b, c, d;
  if (!has_avx2() || !__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return (a >> 4) & 1;
#else
  return false;
#endif
}

// Whether this CPU can run level `isa`: level 3 runs here with AVX-VNNI, or with AVX-512 VNNI's
// encoding of the same 256-bit instruction (how tests run that path on an AVX-512 machine).
bool can_run(int isa) {
  switch (isa) {
    case GENERIC: return true;
    case AVX2: return has_avx2();
    case AVX512: return has_avx512();
    case AVXVNNI: return has_avxvnni() || has_avx512vnni();
    case AVX512VNNI: return has_avx512vnni();
  }
  return false;
}

int detect_isa() {
  if (has_avx512vnni()) return AVX512VNNI;
  if (has_avx512()) return AVX512;
  if (has_avxvnni()) return AVXVNNI;
  if (has_avx2()) return AVX2;
  return GENERIC;
}

int g_isa = detect_isa();

// The float arithmetic's path at level `isa`.
int float_path(int isa) { return isa == AVX512VNNI ? AVX512 : isa == AVXVNNI ? AVX2 : isa; }

void run_range(const Problem& p, int transposed, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
#if MF_X86
  const int isa = float_path(g_isa);
  if (isa == AVX512 && run_avx512(p, transposed, n0, n1)) return;
  if (isa >= AVX2 && run_avx2(p, transposed, n0, n1)) return;
#endif
  run_portable(p, transposed, n0, n1);
}

// ---- thread pool ---------------------------------------------------------------------------------
// Workers spin for up to 2 ms for the next job (a decode step's products come every few tens of
// microseconds, between attention ops that run on the calling thread; waking a sleeping thread costs
// more than a small product), then sleep on a condition variable so an idle engine costs no CPU. Threads do not
// survive fork(): a forked child computes on its calling thread alone.
// Waiting (the caller for its parts, a worker for the next job) pauses for the first SPIN_PAUSES rounds,
// then yields the core at each round: where the cores are shared (another engine, any busy process),
// a thread that only paused kept the core from the very thread it waited for. Two processes decoding
// the default model on 2 cores measured 1.5 tok/s each that way, against 37 for one alone. Where
// nothing else wants the core, a yield returns at once and the wait stays a spin. The cost: a thread
// busy-polling beside us gets the core too (a pipeline's ranks on one machine over MLX's ring lost
// about a quarter of their rate); 16,384 pauses kept that rate but left two engines at a quarter to a
// half of one alone (docs/earlier-results/pipeline.md).
constexpr int SPIN_PAUSES = 2048;

inline void cpu_relax() {
#if MF_X86
  _mm_pause();
#endif
}

inline void wait_round(int64_t i) {
  if (i < SPIN_PAUSES)
    cpu_relax();
  else
    std::this_thread::yield();
}

class Pool {
 public:
  ~Pool() { resize(0); }

  void resize(int workers) {
    if ((int)threads_.size() == workers && owner_ == getpid()) return;
    if (owner_ == getpid()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_.store(true);
        generation_.fetch_add(1);
      }
      cv_.notify_all();
      for (auto& t : threads_) t.join();
    } else {
      for (auto& t : threads_) t.detach();  // the parent's threads: not in this process
    }
    threads_.clear();
    stop_.store(false);
    owner_ = getpid();
    // A worker starts from the generation at its creation, not at its first instruction: a job
    // posted before it gets to run must still count as new.
    const uint64_t now = generation_.load();
    for (int i = 0; i < workers; i++) threads_.emplace_back([this, i, now] { loop(i + 1, now); });
  }

  // Run fn(part) for part in 0..parts-1; part 0 on the calling thread.
  template <class F>
  void run(int parts, F&& fn) {
    if (parts <= 1 || (int)threads_.size() < parts - 1 || owner_ != getpid()) {
      for (int part = 0; part < parts; part++) fn(part);
      return;
    }
    job_ = [&fn](int part) { fn(part); };
    parts_ = parts;
    pending_.store(parts - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    fn(0);
    for (int64_t i = 0; pending_.load(std::memory_order_acquire) != 0; i++) wait_round(i);
  }

  int workers() const { return owner_ == getpid() ? (int)threads_.size() : 0; }

 private:
  void loop(int part, uint64_t seen) {
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; generation_.load(std::memory_order_acquire) == seen; i++) {
        wait_round(i);
        if ((i & 255) == 255 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(2000)) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return generation_.load() != seen; });
        }
      }
      seen = generation_.load();
      if (stop_.load()) return;
      if (part < parts_) {
        job_(part);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::function<void(int)> job_;
  int parts_ = 0;
  pid_t owner_ = getpid();
};

Pool g_pool;
std::mutex g_call_mu;  // one matmul at a time uses the pool

}  // namespace

namespace mf {

void run_parts(int parts, void (*fn)(void*, int), void* arg) {
  std::lock_guard<std::mutex> lock(g_call_mu);
  if (g_pool.workers() < parts - 1) g_pool.resize(parts - 1);
  g_pool.run(parts, [&](int part) { fn(arg, part); });
}

int current_isa() { return float_path(g_isa); }
int current_level() { return g_isa; }
bool cpu_has_avxvnni() { return has_avxvnni(); }

}  // namespace mf

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// Bumped whenever an exported signature or the layout it reads changes; the binding refuses a
// library whose number differs from its own (a checkout updated without reinstalling).
// 2: the module function qmatmul; 3: its row layout argument; 4: row and group ids (sparse products);
// 5: the block kernel (mf_blockmatmul, blockmatmul.cpp) and its module function blockmatmul; 6: rows of
// stored matrices (mf_rows, rows.cpp) and attention (mf_attention, attention.cpp); 7: a gated FFN layer in
// one call (mf_gated_ffn, gated_ffn.cpp); 8: the arithmetic argument (q8.h) of every product, levels 3 and 4;
// 9: the channel-major product (mf_cm_bytes, mf_cm_relayout, mf_cm_matmul; channel_major.cpp); 10: its
// layout's outputs padded to 64 instead of 256, its gated FFN (mf_cm_gated_ffn), mf_gelu_tanh_mul
MF_EXPORT int mf_abi_version() { return 10; }

// The level this CPU runs (see Isa above): 0 portable, 1 AVX2, 2 AVX-512 BW, 3 AVX-VNNI, 4 AVX-512 VNNI.
MF_EXPORT int mf_cpu_isa() { return g_isa; }

// Whether this CPU can run level `isa` (tests force every level it can).
MF_EXPORT int mf_can_run_isa(int isa) { return can_run(isa) ? 1 : 0; }

// Force a level (tests compare every level this CPU can run); returns the previous one, or -1 if the
// CPU cannot run the one asked for.
MF_EXPORT int mf_set_isa(int isa) {
  if (!can_run(isa)) return -1;
  int old = g_isa;
  g_isa = isa;
  return old;
}

// x [T, K] (K a multiple of 32) as the q8 arithmetic quantizes it (q8_quantize.cpp), in natural order:
// codes q [T, K], scales d [T, K / 8] (quarter u of block b at t * K / 8 + u * K / 32 + b) and S(b)
// [T, K / 32] (tests compare them with the plain-ops reference).
MF_EXPORT int mf_q8_quantize(const float* x, int64_t T, int64_t K, int8_t* q, float* d, float* s) {
  if (K % 32 != 0 || T < 0) return -40;
  std::vector<int32_t> s8(T * (K / 8));
  ActRows rows{T, K, ORDER_NATURAL, q, d, s, s8.data()};
  quantize_rows(x, K, T, ORDER_NATURAL, rows);
  return 0;
}

// Whether a product of this matrix runs the q8 arithmetic when asked to (q8.h q8_reads); else it
// runs the float arithmetic.
MF_EXPORT int mf_q8_reads(int kind, int bits, int group, int transposed) {
  return q8_reads(kind, bits, group, transposed != 0) ? 1 : 0;
}

// y = x @ W^T (transposed) or x @ W, see the top of this file. `layout`: where rows lie (Problem's rpb,
// wb, wr, wg, sb, sr, sg), or null for a plain matrix; not transposed, only wr, sr and sg are read.
// row_ids / group_ids: a sparse product over listed blocks, rows or groups (see Problem), or null;
// the caller has checked that every id lies inside the memory the layout describes. Returns 0, or a
// negative code for bad arguments (checked again in Python, which names them).
MF_EXPORT int mf_qmatmul(const float* x, int64_t T, int64_t K, const uint32_t* w, const void* scales, const void* biases,
               int scale_type, int64_t N, int bits, int group, int transposed, float* y, int threads,
               const int64_t* layout, const int32_t* row_ids, const int32_t* group_ids, int arith) {
  if (bits != 2 && bits != 4 && bits != 8) return -1;
  if (group <= 0 || group % 8 != 0) return -2;
  const int64_t packed = transposed ? K : N;
  if (packed % group != 0) return -3;
  if (scale_type < F16 || scale_type > F32) return -4;
  const int64_t ssize = scale_type == F32 ? 4 : 2, groups = packed / group;
  int64_t lay[7] = {transposed ? N : 1, 0, packed * bits / 8, group * bits / 8, 0, groups * ssize, ssize};
  if (layout != nullptr) {
    if (layout[0] < 1) return -5;
    std::memcpy(lay, layout, sizeof(lay));
  }
  if (group_ids != nullptr && !transposed) return -6;
  if (arith != 0 && arith != 1) return -7;
  if (arith == 1 && q8_reads(0, bits, group, transposed)) {  // the q8 arithmetic (q8_matmul.cpp)
    const int kind = bits == 2 ? QK_AFF2 : bits == 4 ? QK_AFF4 : QK_AFF8;
    const QMatrix m{kind, scale_type, group, reinterpret_cast<const uint8_t*>(w), static_cast<const char*>(scales),
                    static_cast<const char*>(biases), N, K, lay[0], lay[1], lay[2], lay[3], lay[4], lay[5], lay[6],
                    row_ids, group_ids};
    return q8_matmul(m, x, T, y, threads);
  }
  std::lock_guard<std::mutex> lock(g_call_mu);
  static std::vector<float> xsum, xperm;  // scratch, reused across calls (one call at a time)
  if (transposed) {
    const int64_t groups = K / group;
    xsum.resize(T * groups);
    if (bits == 4 && group % 32 == 0) {
      xperm.resize(T * K);
      for (int64_t i = 0; i < T * K; i += 32)
        for (int j = 0; j < 16; j++) {
          xperm[i + j] = x[i + 2 * j];
          xperm[i + 16 + j] = x[i + 2 * j + 1];
        }
    }
    for (int64_t t = 0; t < T; t++)
      for (int64_t g = 0; g < groups; g++) {
        float s = 0.f;
        for (int64_t j = g * group; j < (g + 1) * group; j++) s += x[t * K + j];
        xsum[t * groups + g] = s;
      }
  }
  // Split outputs into equal parts, group-aligned when W is not transposed (a group spans columns).
  const int64_t unit = transposed ? 1 : group, units = N / unit;
  int parts = threads < 1 ? 1 : threads;
  if (parts > units) parts = (int)units;
  // Small problems do not pay for waking threads: ~64K weights per part at least.
  const int64_t weights = K * N;
  while (parts > 1 && weights / parts < 65536) parts--;
  const Problem p{x, w, scales, biases, scale_type, T, K, N, bits, group, y, xsum.data(), xperm.data(),
                  lay[0], lay[1], lay[2], lay[3], lay[4], lay[5], lay[6], row_ids, group_ids};
  if (g_pool.workers() < parts - 1) g_pool.resize(parts - 1);  // grows once; a forked child starts its own
  g_pool.run(parts, [&](int part) {
    const int64_t a = units * part / parts, b = units * (part + 1) / parts;
    run_range(p, transposed, a * unit, b * unit);
  });
  return 0;
}

}  // extern "C"

namespace {

// A C-contiguous float32 buffer of exactly `floats` values, or a Python error naming `what`.
bool float_buffer(PyObject* obj, Py_buffer* view, int64_t floats, const char* what, bool writable) {
  if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0) {
    PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s float32 array", what, writable ? " writable" : "");
    return false;
  }
  const bool f32 = view->itemsize == 4 && view->format != nullptr && view->format[0] == 'f' && view->format[1] == 0;
  if (!f32 || view->len != floats * 4) {
    PyErr_Format(PyExc_ValueError, "%s must hold %lld float32 values (got %lld bytes of format %s)", what,
                 (long long)floats, (long long)view->len, view->format ? view->format : "?");
    PyBuffer_Release(view);
    return false;
  }
  return true;
}

// qmatmul(x, T, K, w, scales, biases, scale_type, N, bits, group, transposed, y, threads, layout, row_ids,
// group_ids, arith) -> None. x and y: float32 buffers [T, K] and [T, N]; w, scales, biases, layout (7 int64)
// and the ids (int32): addresses (ints, 0 for none) of arrays the caller keeps alive and checked
// (mlx_flash.kernels.qmatmul.StoredMatrix: the matrix once, ids per call).
PyObject* py_qmatmul(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 17) {
    PyErr_SetString(PyExc_TypeError, "qmatmul takes 17 arguments");
    return nullptr;
  }
  long long v[17] = {0};
  for (int i : {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16}) {
    v[i] = PyLong_AsLongLong(args[i]);
    if (v[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  const int64_t T = v[1], K = v[2], N = v[7];
  if (T < 0 || K < 1 || N < 1) {
    PyErr_SetString(PyExc_ValueError, "qmatmul: T must be >= 0 and K, N >= 1");
    return nullptr;
  }
  Py_buffer xb, yb;
  if (!float_buffer(args[0], &xb, T * K, "x", false)) return nullptr;
  if (!float_buffer(args[11], &yb, T * N, "out", true)) {
    PyBuffer_Release(&xb);
    return nullptr;
  }
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mf_qmatmul(static_cast<const float*>(xb.buf), T, K, reinterpret_cast<const uint32_t*>(v[3]),
                  reinterpret_cast<const void*>(v[4]), reinterpret_cast<const void*>(v[5]), (int)v[6], N, (int)v[8],
                  (int)v[9], (int)v[10], static_cast<float*>(yb.buf), (int)v[12],
                  reinterpret_cast<const int64_t*>(v[13]), reinterpret_cast<const int32_t*>(v[14]),
                  reinterpret_cast<const int32_t*>(v[15]), (int)v[16]);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&xb);
  PyBuffer_Release(&yb);
  if (rc != 0) {
    PyErr_Format(PyExc_ValueError, "the CPU kernel refused its arguments (code %d)", rc);
    return nullptr;
  }
  Py_RETURN_NONE;
}

// blockmatmul(x, T, K, w, type, N, out, threads, layout, row_ids, group_ids, arith) -> None: mf_blockmatmul
// (blockmatmul.cpp) on buffers x [T, K] and out [T, N]; w, layout (4 int64) and the ids: addresses
// (0 for none) of arrays the caller keeps alive and checked (mlx_flash.kernels.qmatmul.BlockMatrix).
PyObject* py_blockmatmul(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 12) {
    PyErr_SetString(PyExc_TypeError, "blockmatmul takes 12 arguments");
    return nullptr;
  }
  long long v[12] = {0};
  for (int i : {1, 2, 3, 4, 5, 7, 8, 9, 10, 11}) {
    v[i] = PyLong_AsLongLong(args[i]);
    if (v[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  const int64_t T = v[1], K = v[2], N = v[5];
  if (T < 0 || K < 1 || N < 1) {
    PyErr_SetString(PyExc_ValueError, "blockmatmul: T must be >= 0 and K, N >= 1");
    return nullptr;
  }
  Py_buffer xb, yb;
  if (!float_buffer(args[0], &xb, T * K, "x", false)) return nullptr;
  if (!float_buffer(args[6], &yb, T * N, "out", true)) {
    PyBuffer_Release(&xb);
    return nullptr;
  }
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = mf_blockmatmul(static_cast<const float*>(xb.buf), T, K, reinterpret_cast<const uint8_t*>(v[3]), (int)v[4], N,
                      static_cast<float*>(yb.buf), (int)v[7], reinterpret_cast<const int64_t*>(v[8]),
                      reinterpret_cast<const int32_t*>(v[9]), reinterpret_cast<const int32_t*>(v[10]), (int)v[11]);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&xb);
  PyBuffer_Release(&yb);
  if (rc != 0) {
    PyErr_Format(PyExc_ValueError, "the CPU block kernel refused its arguments (code %d)", rc);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef qmatmul_methods[] = {
    {"qmatmul", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_qmatmul)), METH_FASTCALL,
     "qmatmul(x, T, K, w, scales, biases, scale_type, N, bits, group, transposed, out, threads, layout, row_ids, "
     "group_ids, arith)"},
    {"blockmatmul", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_blockmatmul)), METH_FASTCALL,
     "blockmatmul(x, T, K, w, type, N, out, threads, layout, row_ids, group_ids, arith)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

static struct PyModuleDef qmatmul_module = {PyModuleDef_HEAD_INIT, "_qmatmul",
                                            "The CPU quantized matmul (mlx_flash.kernels.qmatmul is its binding).",
                                            -1, qmatmul_methods};

PyMODINIT_FUNC PyInit__qmatmul(void) { return PyModule_Create(&qmatmul_module); }
