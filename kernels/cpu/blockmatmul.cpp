// The CPU block kernel: float32 activations times weights kept in a GGUF block quantization (Q5_0,
// Q5_1, Q4_K, Q5_K, Q6_K; layouts in gguf_blocks.h), float32 accumulation, no dequantized copy of a
// weight: each block is decoded into 32 or 256 floats on the stack, used for every token of the
// product, and dropped.
//
//   y[T, N] = x[T, K] @ W^T,  W's rows (outputs) a sequence of blocks along K
//
// Three paths, the one qmatmul.cpp chose from the CPU (mf_cpu_isa, forced by mf_set_isa in tests):
// AVX-512 and AVX2 (blockmatmul_x86.cpp: codes widened and multiplied, scales applied per group of
// 16) and the portable loop here (each block decoded into floats, then 16 lanes of products per
// token; compilers vectorize it for the target they build for). Plain-ops reference: kernels/gguf_blocks_ref.py;
// tests/kernels/test_blockmatmul.py compares them on every path this CPU runs.
#include <vector>

#include "gguf_blocks.h"
#include "q8.h"

using namespace mf;

namespace {

constexpr int LANES = 16;

template <int TYPE>
MF_INLINE void rows_typed(const BlockProblem& p, int64_t n0, int64_t n1, float* acc) {
  constexpr int QK = block_weights(TYPE);
  const int64_t blocks = p.K / QK;
  alignas(64) float w[QK];
  for (int64_t n = n0; n < n1; n++) {
    const int64_t rb = p.row_ids ? p.row_ids[n / p.rpb] : n / p.rpb;
    const uint8_t* row = p.w + rb * p.wb + (n % p.rpb) * p.wr;
    for (int64_t i = 0; i < p.T * LANES; i++) acc[i] = 0.f;
    for (int64_t g = 0; g < blocks; g++) {
      decode_block<TYPE>(row + (p.group_ids ? p.group_ids[g] : g) * p.wg, w);
      for (int64_t t = 0; t < p.T; t++) {
        const float* x = p.x + t * p.K + g * QK;
        float* a = acc + t * LANES;
        for (int i = 0; i < QK; i += LANES)
          for (int l = 0; l < LANES; l++) a[l] += w[i + l] * x[i + l];
      }
    }
    for (int64_t t = 0; t < p.T; t++) {
      const float* a = acc + t * LANES;
      float s8[8];
      for (int l = 0; l < 8; l++) s8[l] = a[l] + a[l + 8];
      const float s4[4] = {s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]};
      p.y[t * p.N + n] = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    }
  }
}

MF_INLINE void rows_body(const BlockProblem& p, int64_t n0, int64_t n1) {
  std::vector<float> acc(p.T * LANES);
  switch (p.type) {
    case Q5_0: return rows_typed<Q5_0>(p, n0, n1, acc.data());
    case Q5_1: return rows_typed<Q5_1>(p, n0, n1, acc.data());
    case Q4_K: return rows_typed<Q4_K>(p, n0, n1, acc.data());
    case Q5_K: return rows_typed<Q5_K>(p, n0, n1, acc.data());
    case Q6_K: return rows_typed<Q6_K>(p, n0, n1, acc.data());
  }
}

struct Job {
  const BlockProblem* p;
  int64_t units;
  int parts;
};

void run_part(void* arg, int part) {
  const Job& j = *static_cast<const Job*>(arg);
  const int64_t a = j.units * part / j.parts, b = j.units * (part + 1) / j.parts;
  if (a >= b) return;
#if MF_X86
  const int isa = current_isa();
  if (isa == 2) return block_rows_avx512(*j.p, a, b);
  if (isa == 1) return block_rows_avx2(*j.p, a, b);
#endif
  block_rows_portable(*j.p, a, b);
}

}  // namespace

namespace mf {

void block_rows_portable(const BlockProblem& p, int64_t n0, int64_t n1) { rows_body(p, n0, n1); }

}  // namespace mf

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// y = x @ W^T for W in GGUF block type `type` (gguf_blocks.h). `layout`: rpb, wb, wr, wg (BlockProblem),
// or null for a plain [N, K/QK*bytes] matrix; row_ids / group_ids as there, or null; arith 0 the float
// arithmetic, 1 the q8 arithmetic (q8.h); the caller has
// checked that every block they name lies inside the memory the layout describes. Returns 0, or a
// negative code for bad arguments (checked again in Python, which names them).
MF_EXPORT int mf_blockmatmul(const float* x, int64_t T, int64_t K, const uint8_t* w, int type, int64_t N, float* y,
                             int threads, const int64_t* layout, const int32_t* row_ids, const int32_t* group_ids,
                             int arith) {
  if (block_bytes(type) == 0) return -1;
  const int QK = block_weights(type);
  if (K % QK != 0) return -2;
  int64_t lay[4] = {N, 0, K / QK * block_bytes(type), block_bytes(type)};
  if (layout != nullptr) {
    if (layout[0] < 1) return -5;
    std::memcpy(lay, layout, sizeof(lay));
  }
  if (arith != 0 && arith != 1) return -7;
  if (arith == 1) {  // the q8 arithmetic (q8_matmul.cpp)
    const QMatrix m{type, 0, 0, w, nullptr, nullptr, N, K, lay[0], lay[1], lay[2], lay[3], 0, 0, 0, row_ids, group_ids};
    return q8_matmul(m, x, T, y, threads);
  }
  std::vector<float> sums(T * (K / 16));
  for (int64_t t = 0; t < T; t++)
    for (int64_t g = 0; g < K / 16; g++) {
      float s = 0.f;
      for (int j = 0; j < 16; j++) s += x[t * K + 16 * g + j];
      sums[t * (K / 16) + g] = s;
    }
  const BlockProblem p{x, w, type, T, K, N, y, lay[0], lay[1], lay[2], lay[3], row_ids, group_ids, sums.data()};
  int parts = threads < 1 ? 1 : threads;
  if (parts > N) parts = (int)N;
  while (parts > 1 && K * N / parts < 65536) parts--;  // small products do not pay for waking threads
  Job job{&p, N, parts};
  run_parts(parts, run_part, &job);
  return 0;
}

}  // extern "C"
