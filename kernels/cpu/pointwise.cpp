// The small per-token steps around the products, on the CPU: RMS normalization, rotary position
// embedding, the gated FFN's activation and the KV cache's append. Each is a few microseconds of
// work that a framework's generic ops turn into tens (MLX's CPU build composes rms_norm and rope from
// several elementwise passes: 35 and 98 us for one decode token of the default model); here each is
// one pass, float32 throughout. Plain-ops reference: kernels/pointwise_ref.py.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "qmatmul.h"

namespace mf {
int current_isa();
}  // namespace mf

using namespace mf;

namespace {

#define MF_INLINE inline __attribute__((always_inline))

constexpr int L = 16;

// y = x / sqrt(mean(x^2) + eps) * w over rows of D; the sum of squares in L lanes, added in a fixed
// tree, so the result does not depend on the instruction set's width.
MF_INLINE void rms_rows(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* y) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * D;
    float acc[L] = {0.f};
    int64_t d = 0;
    for (; d + L <= D; d += L)
      for (int l = 0; l < L; l++) acc[l] += xr[d + l] * xr[d + l];
    for (int64_t e = d; e < D; e++) acc[e - d] += xr[e] * xr[e];
    for (int s = L / 2; s >= 1; s /= 2)
      for (int l = 0; l < s; l++) acc[l] += acc[l + s];
    const float inv = 1.f / std::sqrt(acc[0] / (float)D + eps);
    float* yr = y + r * D;
    for (int64_t e = 0; e < D; e++) yr[e] = (xr[e] * inv) * w[e];
  }
}

MF_INLINE void silu_mul_body(const float* g, const float* u, int64_t n, float* y) {
  for (int64_t i = 0; i < n; i++) y[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// GELU with the tanh approximation (GeGLU, Gemma's gate): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
MF_INLINE void gelu_tanh_mul_body(const float* g, const float* u, int64_t n, float* y) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t i = 0; i < n; i++) {
    const float v = g[i];
    y[i] = 0.5f * v * (1.f + std::tanh(c * (v + 0.044715f * v * v * v))) * u[i];
  }
}

#if MF_X86
__attribute__((target("avx512f,avx2,fma"))) void rms_avx512(const float* x, const float* w, float eps, int64_t rows,
                                                            int64_t D, float* y) {
  rms_rows(x, w, eps, rows, D, y);
}
__attribute__((target("avx2,fma"))) void rms_avx2(const float* x, const float* w, float eps, int64_t rows, int64_t D,
                                                  float* y) {
  rms_rows(x, w, eps, rows, D, y);
}
#endif
void rms_portable(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* y) {
  rms_rows(x, w, eps, rows, D, y);
}

}  // namespace

#define MF_EXPORT __attribute__((visibility("default")))

extern "C" {

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w, rows of D floats (x and y may be the same).
MF_EXPORT int mf_rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* y) {
  if (rows < 0 || D < 1) return -1;
#if MF_X86
  const int isa = current_isa();
  if (isa == 2) return rms_avx512(x, w, eps, rows, D, y), 0;
  if (isa == 1) return rms_avx2(x, w, eps, rows, D, y), 0;
#endif
  rms_portable(x, w, eps, rows, D, y);
  return 0;
}

// Rotary position embedding of x [B, H, T, hd] (strides xs: batch, head, token, in elements; the head
// dimension contiguous) into y [B, H, T, hd] (contiguous): the first `dims` features of token t of row
// b turn by angle (pos[b] + t) * scale * inv_freq[i] for pair i, the pairs interleaved (2i, 2i + 1:
// `traditional`) or halves (i, i + dims / 2); features past `dims` are copied.
MF_EXPORT int mf_rope(const float* x, int64_t B, int64_t H, int64_t T, int64_t hd, const int64_t* xs,
                      const float* inv_freq, int64_t dims, int traditional, const int32_t* pos, float scale,
                      float* y) {
  if (dims < 2 || dims % 2 || dims > hd) return -1;
  const int64_t half = dims / 2;
  float cs[512], sn[512];
  if (half > 512) return -2;
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++) {
      const float p = (float)(pos[b] + t) * scale;
      for (int64_t i = 0; i < half; i++) {
        const float a = p * inv_freq[i];
        cs[i] = std::cos(a);
        sn[i] = std::sin(a);
      }
      for (int64_t h = 0; h < H; h++) {
        const float* xr = x + b * xs[0] + h * xs[1] + t * xs[2];
        float* yr = y + ((b * H + h) * T + t) * hd;
        if (traditional) {
          for (int64_t i = 0; i < half; i++) {
            const float x0 = xr[2 * i], x1 = xr[2 * i + 1];
            yr[2 * i] = x0 * cs[i] - x1 * sn[i];
            yr[2 * i + 1] = x0 * sn[i] + x1 * cs[i];
          }
        } else {
          for (int64_t i = 0; i < half; i++) {
            const float x0 = xr[i], x1 = xr[i + half];
            yr[i] = x0 * cs[i] - x1 * sn[i];
            yr[i + half] = x0 * sn[i] + x1 * cs[i];
          }
        }
        for (int64_t d = dims; d < hd; d++) yr[d] = xr[d];
      }
    }
  return 0;
}

// y = silu(g) * u = g / (1 + exp(-g)) * u over n values (the gated FFN's activations; y may be g or u).
MF_EXPORT int mf_silu_mul(const float* g, const float* u, int64_t n, float* y) {
  if (n < 0) return -1;
  silu_mul_body(g, u, n, y);
  return 0;
}

// y = gelu_tanh(g) * u over n values (a GeGLU FFN's activations; y may be g or u).
MF_EXPORT int mf_gelu_tanh_mul(const float* g, const float* u, int64_t n, float* y) {
  if (n < 0) return -1;
  gelu_tanh_mul_body(g, u, n, y);
  return 0;
}

// Copy x [B, H, T, hd] (strides xs, the last dimension contiguous) into buf [B, H, cap, hd]
// (contiguous) at tokens offset .. offset + T: a KV cache's append, in place.
MF_EXPORT int mf_write_tokens(float* buf, int64_t B, int64_t H, int64_t cap, int64_t hd, const float* x,
                              const int64_t* xs, int64_t T, int64_t offset) {
  if (offset < 0 || offset + T > cap) return -1;
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t t = 0; t < T; t++)
        std::memcpy(buf + ((b * H + h) * cap + offset + t) * hd, x + b * xs[0] + h * xs[1] + t * xs[2],
                    hd * sizeof(float));
  return 0;
}

}  // extern "C"
