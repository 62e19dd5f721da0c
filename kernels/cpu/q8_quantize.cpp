// The activations of the q8 arithmetic (q8.h): rows of x quantized to int8 codes with a scale per 8
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

// One quarter of 8 inputs: natural-order codes, the scale, the sum of the codes.
inline void quantize_quarter(const float* x, int8_t* q, float* d, int32_t* sum) {
  float amax = 0.f;
  for (int j = 0; j < 8; j++) {
    const float a = std::fabs(x[j]);
    amax = a > amax ? a : amax;
  }
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s = 0;
  for (int j = 0; j < 8; j++) {
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

// S(b) of q8.h: each quarter's scale times its code sum, rounded, added in order.
inline float block_sum(const float* d, const int32_t* s, int64_t stride) {
  float acc = d[0] * (float)s[0];
  for (int u = 1; u < QUARTERS; u++) {
    const float a = d[u * stride] * (float)s[u * stride];
    acc = acc + a;
  }
  return acc;
}

// A quarter's 8 natural-order codes into their places in `order` (q8.h).
void reorder_quarter(const int8_t* nat, int order, int8_t* out) {
  if (order == ORDER_NIBBLES) {
    for (int i = 0; i < 4; i++) out[i] = nat[2 * i], out[4 + i] = nat[2 * i + 1];
  } else if (order == ORDER_CRUMBS) {
    for (int c = 0; c < 8; c++) out[4 * ((c % 4) / 2) + 2 * (c % 2) + c / 4] = nat[c];
  } else {
    std::memcpy(out, nat, 8);
  }
}

}  // namespace

void quantize_rows(const float* x, int64_t K, int64_t T, int order, ActRows& out) {
  const int64_t nb = K / 32;
  out.T = T;
  out.K = K;
  out.order = order;
  int8_t nat[8];
  for (int64_t t = 0; t < T; t++) {
    const float* xr = x + t * K;
    int8_t* q = out.q + t * K;
    float* d = out.d + t * QUARTERS * nb;
    int32_t* s8 = out.s8 + t * QUARTERS * nb;
    for (int64_t b = 0; b < nb; b++) {
      for (int u = 0; u < QUARTERS; u++) {
        quantize_quarter(xr + 32 * b + 8 * u, nat, d + u * nb + b, s8 + u * nb + b);
        reorder_quarter(nat, order, q + 32 * b + 8 * u);
      }
      out.s[t * nb + b] = block_sum(d + b, s8 + b, nb);
    }
  }
}

void quantize_tile(const float* x, int64_t K, int64_t t0, int64_t t_end, int lanes, ActTile& out) {
  const int64_t nb = K / 32;
  out.K = K;
  out.lanes = lanes;
  int8_t q[8];
  for (int t = 0; t < lanes; t++) {
    const bool real = t0 + t < t_end;
    const float* xr = x + (t0 + t) * K;
    for (int64_t b = 0; b < nb; b++) {
      float d[QUARTERS] = {0.f};
      int32_t s8[QUARTERS] = {0};
      for (int u = 0; u < QUARTERS; u++) {
        if (real)
          quantize_quarter(xr + 32 * b + 8 * u, q, d + u, s8 + u);
        else
          std::memset(q, 0, sizeof(q));
        for (int c = 0; c < 2; c++) std::memcpy(out.q + ((8 * b + 2 * u + c) * lanes + t) * 4, q + 4 * c, 4);
        out.d[(QUARTERS * b + u) * lanes + t] = d[u];
        out.s8[(QUARTERS * b + u) * lanes + t] = s8[u];
      }
      out.s[b * lanes + t] = block_sum(d, s8, 1);
    }
  }
}

}  // namespace mf
