// A gated FFN layer in one call: y = down(silu(x G^T) * (x U^T)), gate and up two stored matrices of
// F rows, or one of 2F rows (gate first), and down [D, F]; dense, or sparse over the units each
// matrix lists (a neuron cache's active slots: F is then the listed rows' width). The same products
// and the same activation as separate calls (mf_qmatmul or mf_blockmatmul, mf_silu_mul), so results
// are identical to the bit; what it saves is the framework's dispatch of three or four operators and
// their intermediate arrays per layer. Plain-ops reference: kernels/pointwise_ref.py gated_ffn_ref.
#include <cstdint>

#include "matrix_ref.h"

extern "C" {
int mf_qmatmul(const float* x, int64_t T, int64_t K, const uint32_t* w, const void* scales, const void* biases,
               int scale_type, int64_t N, int bits, int group, int transposed, float* y, int threads,
               const int64_t* layout, const int32_t* row_ids, const int32_t* group_ids, int arith);
int mf_blockmatmul(const float* x, int64_t T, int64_t K, const uint8_t* w, int type, int64_t N, float* y, int threads,
                   const int64_t* layout, const int32_t* row_ids, const int32_t* group_ids, int arith);
int mf_silu_mul(const float* g, const float* u, int64_t n, float* y);
}

namespace {

int product(const mf_matrix& m, const float* x, int64_t T, int64_t K, float* y, int threads) {
  if (m.kind == 0)
    return mf_qmatmul(x, T, K, reinterpret_cast<const uint32_t*>(m.w), m.scales, m.biases, m.scale_type, m.n_out,
                      m.bits, m.group, m.transposed, y, threads, m.layout, m.row_ids, m.group_ids, m.arith);
  if (!m.transposed) return -20;  // block rows are always outputs
  return mf_blockmatmul(x, T, K, m.w, m.kind, m.n_out, y, threads, m.layout, m.row_ids, m.group_ids, m.arith);
}

}  // namespace

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// x [T, K] -> y [T, down.n_out]. `up` null: `gate` holds gate|up (2F outputs); else each holds F.
// `hidden`: scratch of 2 T F floats (the caller's memory, so a framework counts it); down reads F
// inputs. Returns 0 or a negative code.
MF_EXPORT int mf_gated_ffn(const float* x, int64_t T, int64_t K, const mf_matrix* gate, const mf_matrix* up,
                           const mf_matrix* down, float* hidden, float* y, int threads) {
  if (T < 0 || gate == nullptr || down == nullptr) return -21;
  if (up == nullptr ? gate->n_out % 2 != 0 : up->n_out != gate->n_out) return -22;
  const int64_t F = up == nullptr ? gate->n_out / 2 : gate->n_out;
  int rc = product(*gate, x, T, K, hidden, threads);
  if (rc < 0) return rc;
  if (up != nullptr) {  // gate [T, F] then up [T, F]: one pass over both
    rc = product(*up, x, T, K, hidden + T * F, threads);
    if (rc < 0) return rc;
    mf_silu_mul(hidden, hidden + T * F, T * F, hidden);
  } else {
    // Rows [T, 2F]: row t's activations go to hidden[t F, (t + 1) F): row 0 in place (each value from its
    // own gate and up), later rows below their own inputs (2 t F >= (t + 1) F), none overwritten before use.
    for (int64_t t = 0; t < T; t++) {
      float* row = hidden + t * 2 * F;
      mf_silu_mul(row, row + F, F, hidden + t * F);
    }
  }
  return product(*down, hidden, T, F, y, threads);
}

}  // extern "C"
