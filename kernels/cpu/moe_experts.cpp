// A MoE layer's routed experts in one call: for every expert any token routes to, in ascending expert
// order, the tokens routed to it gathered (ascending), its gated FFN over them (mf_gated_ffn, the
// products as stored) and each token's output added to y times its router weight. The same gathers,
// products and sums in the same order as one call per expert (models/moe.py's reference loop): the
// result is identical to the bit. What it saves is a framework dispatch, a gather and a scatter per
// expert. Plain-ops reference: kernels/pointwise_ref.py moe_experts_ref.
#include <cstdint>
#include <vector>

#include "matrix_ref.h"

extern "C" int mf_gated_ffn(const float* x, int64_t T, int64_t K, const mf_matrix* gate, const mf_matrix* up,
                            const mf_matrix* down, float* hidden, float* y, int threads);

namespace {

// One expert's share: its tokens gathered, its gated FFN, each output row scaled by its token's weight
// (rounded before the sum, as the per-expert reference does). `xe`, `hidden`: scratch; `out` [n, Dout].
int expert_rows(const float* x, int64_t D, const std::vector<int64_t>& rows, int64_t K, const float* wts,
                const mf_matrix* const* m, int64_t Dout, float* xe, float* hidden, float* out, int threads) {
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t i = 0; i < n; i++) {
    const float* src = x + (rows[i] / K) * D;
    for (int64_t d = 0; d < D; d++) xe[i * D + d] = src[d];
  }
  const int rc = mf_gated_ffn(xe, n, D, m[0], m[1], m[2], hidden, out, threads);
  if (rc < 0) return rc;
  for (int64_t i = 0; i < n; i++) {
    const float w = wts[rows[i]];
    for (int64_t d = 0; d < Dout; d++) out[i * Dout + d] = out[i * Dout + d] * w;
  }
  return 0;
}

}  // namespace

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// x [N, D]; ids, wts [N, K] (each row's K distinct experts and their weights); experts [E * 3]: expert
// e's gate, up and down (up null: gate holds gate|up; gate null: expert e is not in this call, its
// tokens skipped, so a caller can run a layer's experts in waves that add up in ascending order).
// y [N, Dout] is added to (zeros for one call over every routed expert). scratch: floats for the
// largest expert's share, N (D + 2 F + Dout) with F its width (mf_moe_experts_scratch says how many).
// Each expert's products are split between the threads, as a call per expert would split them.
// Returns 0 or a negative code.
MF_EXPORT int mf_moe_experts(const float* x, int64_t N, int64_t D, const int32_t* ids, const float* wts, int64_t K,
                             int64_t E, const mf_matrix* const* experts, int64_t Dout, float* scratch, float* y,
                             int threads) {
  if (N < 0 || K <= 0 || E <= 0 || experts == nullptr) return -31;
  std::vector<std::vector<int64_t>> rows(E);  // expert -> (token * K + slot), tokens ascending
  for (int64_t t = 0; t < N; t++)
    for (int64_t j = 0; j < K; j++) {
      const int32_t e = ids[t * K + j];
      if (e < 0 || e >= E) return -32;
      rows[e].push_back(t * K + j);
    }
  std::vector<int64_t> order;  // the experts of this call any token routes to, ascending
  for (int64_t e = 0; e < E; e++) {
    if (rows[e].empty() || experts[3 * e] == nullptr) continue;
    if (experts[3 * e + 2] == nullptr || experts[3 * e + 2]->n_out != Dout) return -33;
    order.push_back(e);
  }
  auto add = [&](int64_t e, const float* src) {  // an expert's weighted rows into y
    const std::vector<int64_t>& rs = rows[e];
    for (int64_t i = 0; i < static_cast<int64_t>(rs.size()); i++) {
      float* out = y + (rs[i] / K) * Dout;
      for (int64_t d = 0; d < Dout; d++) out[d] = out[d] + src[i * Dout + d];
    }
  };
  for (int64_t e : order) {  // each expert in the caller's scratch, added before the next
    const int64_t n = static_cast<int64_t>(rows[e].size());
    const mf_matrix* const* m = experts + 3 * e;
    const int64_t F = m[1] == nullptr ? m[0]->n_out / 2 : m[0]->n_out;
    float* xe = scratch;
    float* hidden = xe + n * D;
    float* out = hidden + 2 * n * F;
    const int rc = expert_rows(x, D, rows[e], K, wts, m, Dout, xe, hidden, out, threads);
    if (rc < 0) return rc;
    add(e, out);
  }
  return 0;
}

// Floats of scratch mf_moe_experts needs for N tokens over experts of at most F neurons.
MF_EXPORT int64_t mf_moe_experts_scratch(int64_t N, int64_t D, int64_t F, int64_t Dout) {
  return N * (D + 2 * F + Dout);
}

}  // extern "C"
