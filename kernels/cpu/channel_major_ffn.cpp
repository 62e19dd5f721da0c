// A gated FFN layer of channel-major products in one call (TEAL activation sparsity, see
// channel_major.cpp): y = down(act(x G^T) * (x U^T)), gate and up skipping the channels of x with
// |x| <= t_gu, down those of the activations with |h| <= t_down (a negative threshold: every channel).
// The same products and activation as the separate calls (mf_cm_matmul, mf_silu_mul or
// mf_gelu_tanh_mul), in the same order, so the result is identical to the bit; what it saves is the
// framework's dispatch of three operators and their intermediate arrays, and the Python between them:
// on the default model (d_model 576, 30 layers) the dense path's one gated_ffn call per layer made a
// sparse step of three calls no faster at 40% of inputs zeroed even though its products were.
// Plain-ops reference: the three calls (tests/kernels/test_channel_major_ffn.py).
#include <cmath>

#include "channel_major.h"
#include "matrix_ref.h"

extern "C" {
int mf_silu_mul(const float* g, const float* u, int64_t n, float* y);       // pointwise.cpp
int mf_gelu_tanh_mul(const float* g, const float* u, int64_t n, float* y);  // pointwise.cpp
}

namespace mf {
void run_parts(int parts, void (*fn)(void*, int), void* arg);  // qmatmul.cpp: the kernels' thread pool
}  // namespace mf

using namespace mf;

namespace {

// A matrix's shape in the layout, its arguments checked as mf_cm_matmul checks them.
int shape_of(const mf_cm_matrix* m, CmShape* s) {
  if (m == nullptr || m->w == nullptr) return -6;
  return cm_shape(m->n_out, m->k_in, m->bits, m->group, m->scale_type, s);
}

void add(int64_t* to, const int64_t* counts) {
  if (to != nullptr)
    for (int i = 0; i < 3; i++) to[i] += counts[i];
}

// The activations act(gate) * up of T rows, in place in `hidden`: rows [T, 2F] (gate|up) when `fused`,
// else gate [T, F] then up [T, F]; into hidden [T, F]. Threads split the F values of a row (each
// value computed as alone: the same bits), each thread walking the rows in order. Fused, row t's
// results go to hidden[t F, (t + 1) F): row 0 in place, later rows below their own inputs (2 t F >=
// (t + 1) F); value e of row t lands on value e of an earlier row's gate or up (t F + e = (2 t' + j) F
// + e' only where e = e'), which only the thread owning e reads, and already has. On the default model
// one thread took 6 us of a 30-us gate|up product for F = 1536.
struct ActJob {
  int (*act_mul)(const float*, const float*, int64_t, float*);
  float* hidden;
  int64_t T, F;
  bool fused;
  int parts;
};

void act_part(void* arg, int part) {
  const ActJob& j = *static_cast<const ActJob*>(arg);
  if (!j.fused) {
    const int64_t n = j.T * j.F, a = n * part / j.parts, b = n * (part + 1) / j.parts;
    j.act_mul(j.hidden + a, j.hidden + n + a, b - a, j.hidden + a);
    return;
  }
  const int64_t a = j.F * part / j.parts, b = j.F * (part + 1) / j.parts;
  for (int64_t t = 0; t < j.T; t++) {
    float* row = j.hidden + t * 2 * j.F;
    j.act_mul(row + a, row + j.F + a, b - a, j.hidden + t * j.F + a);
  }
}

}  // namespace

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// x [T, K] -> y [T, D]. `up` null: `gate` holds gate|up (2F outputs, gate first); else gate and up
// hold F outputs each; both over K = gate->k_in inputs, thresholded at t_gu. down: D outputs over F
// inputs, thresholded at t_down. act: 0 silu (SwiGLU), 1 gelu with the tanh approximation (GeGLU).
// hidden: scratch of 2 T F floats (the caller's memory, so a framework counts it). Counters (each
// null or 3 int64: rows, active channels, active groups) are added to per matrix, as mf_cm_matmul
// adds to its own. Returns 0 or a negative code (mf_cm_matmul's, and -9: gate and up differ in
// shape, or gate|up has an odd number of outputs; -10: down's inputs are not F; -11: unknown act).
MF_EXPORT int mf_cm_gated_ffn(const float* x, int64_t T, const mf_cm_matrix* gate, const mf_cm_matrix* up,
                              const mf_cm_matrix* down, float t_gu, float t_down, int act, float* hidden, float* y,
                              int threads, int64_t* gate_counters, int64_t* up_counters, int64_t* down_counters) {
  CmShape gs, us, ds;
  int rc = shape_of(gate, &gs);
  if (rc == 0 && up != nullptr) rc = shape_of(up, &us);
  if (rc == 0) rc = shape_of(down, &ds);
  if (rc != 0) return rc;
  if (T < 0) return -7;
  if ((x == nullptr || y == nullptr || hidden == nullptr) && T > 0) return -6;
  if (std::isnan(t_gu) || std::isnan(t_down)) return -8;
  if (up == nullptr ? gs.N % 2 != 0 : (us.N != gs.N || us.K != gs.K)) return -9;
  const int64_t F = up == nullptr ? gs.N / 2 : gs.N;
  if (ds.K != F) return -10;
  if (act != 0 && act != 1) return -11;
  int (*act_mul)(const float*, const float*, int64_t, float*) = act == 0 ? mf_silu_mul : mf_gelu_tanh_mul;
  int64_t counts[3] = {0, 0, 0};
  cm_product(gs, gate->w, x, T, t_gu, hidden, threads, counts);
  add(gate_counters, counts);
  if (up != nullptr) {  // gate [T, F] then up [T, F]
    int64_t uc[3] = {0, 0, 0};
    cm_product(us, up->w, x, T, t_gu, hidden + T * F, threads, uc);
    add(up_counters, uc);
  }
  int parts = threads < 1 ? 1 : threads;
  while (parts > 1 && F / parts < 512) parts--;  // a few hundred values do not pay for waking a thread
  ActJob job{act_mul, hidden, T, F, up == nullptr, parts};
  run_parts(parts, act_part, &job);
  int64_t dc[3] = {0, 0, 0};
  cm_product(ds, down->w, hidden, T, t_down, y, threads, dc);
  add(down_counters, dc);
  return 0;
}

}  // extern "C"
