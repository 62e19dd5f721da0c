// The activations of the q8 arithmetic (q8.h): rows of x quantized to int8 codes with a scale per 16
// inputs, once per product call, in the code order the stored kind's kernels read. Plain C++ that
// compilers vectorize for any target: every operation is exact or correctly rounded (a maximum, one
// division, a multiply, round-to-nearest-even by adding and subtracting 1.5 * 2^23), so the codes are
// the same whatever instructions compute them. Plain-ops reference: kernels/q8_ref.py quantize.
#include <cmath>
#include <cstring>

#include "q8.h"

namespace mf {

namespace {

constexpr float ROUND = 12582912.f;  // 1.5 * 2^23: v + ROUND - ROUND is v rounded to an integer, ties to even (|v| < 2^22)

// One half-block of 16 inputs: natural-order codes, the scale, the sum of the codes.
inline void quantize_half(const float* x, int8_t* q, float* d, int32_t* sum) {
  float amax = 0.f;
  for (int j = 0; j < 16; j++) {
    const float a = std::fabs(x[j]);
    amax = a > amax ? a : amax;
  }
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s = 0;
  for (int j = 0; j < 16; j++) {
    // three statements: a compiler may not fuse the multiply into the add (it would round once, not
    // twice) nor fold the add and subtract (ISO C++ floating point; no -ffast-math here)
    const float p = x[j] * id;
    const float r = p + ROUND;
    const int v = (int)(r - ROUND);
    q[j] = (int8_t)v;
    s += v;
  }
  *d = amax / 127.f;
  *sum = s;
}

// S(b) of q8.h: each half's scale times its code sum, rounded, then added.
inline float block_sum(float d0, int32_t s0, float d1, int32_t s1) {
  const float a = d0 * (float)s0;
  const float b = d1 * (float)s1;
  return a + b;
}

// A half's 16 natural-order codes into its place in `order` (q8.h): 16 bytes.
void reorder_half(const int8_t* nat, int order, int8_t* out) {
  if (order == ORDER_NIBBLES) {
    for (int i = 0; i < 8; i++) out[i] = nat[2 * i], out[8 + i] = nat[2 * i + 1];
  } else if (order == ORDER_CRUMBS) {
    for (int j = 0; j < 4; j++)
      for (int i = 0; i < 4; i++) out[4 * j + i] = nat[4 * i + j];
  } else {
    std::memcpy(out, nat, 16);
  }
}

}  // namespace

void quantize_rows(const float* x, int64_t K, int64_t T, int order, ActRows& out) {
  const int64_t nb = K / 32;
  out.T = T;
  out.K = K;
  out.order = order;
  int8_t nat[16];
  for (int64_t t = 0; t < T; t++) {
    const float* xr = x + t * K;
    int8_t* q = out.q + t * K;
    float* d = out.d + t * 2 * nb;
    int32_t* s16 = out.s16 + t * 2 * nb;
    for (int64_t b = 0; b < nb; b++) {
      for (int u = 0; u < 2; u++) {
        quantize_half(xr + 32 * b + 16 * u, nat, d + u * nb + b, s16 + u * nb + b);
        reorder_half(nat, order, q + 32 * b + 16 * u);
      }
      out.s[t * nb + b] = block_sum(d[b], s16[b], d[nb + b], s16[nb + b]);
    }
  }
}

void quantize_tile(const float* x, int64_t K, int64_t t0, int64_t t_end, int lanes, ActTile& out) {
  const int64_t nb = K / 32;
  out.K = K;
  out.lanes = lanes;
  int8_t q[16];
  for (int t = 0; t < lanes; t++) {
    const bool real = t0 + t < t_end;
    const float* xr = x + (t0 + t) * K;
    for (int64_t b = 0; b < nb; b++) {
      float d[2] = {0.f, 0.f};
      int32_t s16[2] = {0, 0};
      for (int u = 0; u < 2; u++) {
        if (real)
          quantize_half(xr + 32 * b + 16 * u, q, d + u, s16 + u);
        else
          std::memset(q, 0, sizeof(q));
        for (int c = 0; c < 4; c++) std::memcpy(out.q + ((8 * b + 4 * u + c) * lanes + t) * 4, q + 4 * c, 4);
        out.d[(2 * b + u) * lanes + t] = d[u];
        out.s16[(2 * b + u) * lanes + t] = s16[u];
      }
      out.s[b * lanes + t] = block_sum(d[0], s16[0], d[1], s16[1]);
    }
  }
}

}  // namespace mf
