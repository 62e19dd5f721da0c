// The activations of the q8 arithmetic (q8.h): rows of x quantized to int8 codes in blocks of 32,
// once per product call, in the code order the stored kind's kernels read. Plain C++ that compilers
// vectorize for any target: every operation is exact or correctly rounded (a maximum, one division,
// a multiply, round-to-nearest-even by adding and subtracting 1.5 * 2^23), so the codes are the same
// whatever instructions compute them. Plain-ops reference: kernels/q8_ref.py quantize.
#include <cmath>
#include <cstring>

#include "q8.h"

namespace mf {

namespace {

constexpr float ROUND = 12582912.f;  // 1.5 * 2^23: v + ROUND - ROUND is v rounded to an integer, ties to even (|v| < 2^22)

// One block of 32 inputs: natural-order codes, the scale, and the sums of each 16.
inline void quantize_block(const float* x, int8_t* q, float* d, int32_t* s16) {
  float amax = 0.f;
  for (int j = 0; j < 32; j++) {
    const float a = std::fabs(x[j]);
    amax = a > amax ? a : amax;
  }
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum[2] = {0, 0};
  for (int j = 0; j < 32; j++) {
    // three statements: a compiler may not fuse the multiply into the add (it would round once, not
    // twice) nor fold the add and subtract (ISO C++ floating point; no -ffast-math here)
    const float p = x[j] * id;
    const float r = p + ROUND;
    const int v = (int)(r - ROUND);
    q[j] = (int8_t)v;
    sum[j >> 4] += v;
  }
  *d = amax / 127.f;
  s16[0] = sum[0];
  s16[1] = sum[1];
}

// Natural-order codes of a pair of blocks (or one trailing block, b == nullptr) into `order`.
void reorder(const int8_t* a, const int8_t* b, int order, int8_t* out) {
  if (order == ORDER_NIBBLES) {
    if (b == nullptr) {
      for (int i = 0; i < 16; i++) out[i] = a[2 * i], out[16 + i] = a[2 * i + 1];
      return;
    }
    for (int i = 0; i < 16; i++) {
      out[i] = a[2 * i];
      out[16 + i] = b[2 * i];
      out[32 + i] = a[2 * i + 1];
      out[48 + i] = b[2 * i + 1];
    }
    return;
  }
  // CRUMBS: runs of 8 codes 4i + j
  if (b == nullptr) {
    for (int j = 0; j < 4; j++)
      for (int i = 0; i < 8; i++) out[8 * j + i] = a[4 * i + j];
    return;
  }
  const int8_t* src[8] = {a, a, b, b, a, a, b, b};
  const int plane[8] = {0, 1, 0, 1, 2, 3, 2, 3};
  for (int r = 0; r < 8; r++)
    for (int i = 0; i < 8; i++) out[8 * r + i] = src[r][4 * i + plane[r]];
}

}  // namespace

void quantize_rows(const float* x, int64_t K, int64_t T, int order, ActRows& out) {
  const int64_t nb = K / 32;
  out.T = T;
  out.K = K;
  out.order = order;
  int8_t nat[64];
  for (int64_t t = 0; t < T; t++) {
    const float* xr = x + t * K;
    int8_t* q = out.q + t * K;
    float* d = out.d + t * nb;
    float* s = out.s + t * nb;
    int32_t* s16 = out.s16 + t * (K / 16);
    int32_t* s32 = out.s32 + t * nb;
    for (int64_t b = 0; b < nb; b++) {
      int8_t* dst = order == ORDER_NATURAL ? q + 32 * b : nat + 32 * (b & 1);
      quantize_block(xr + 32 * b, dst, d + b, s16 + 2 * b);
      s32[b] = s16[2 * b] + s16[2 * b + 1];
      s[b] = d[b] * (float)s32[b];
      if (order == ORDER_NATURAL) continue;
      if (b & 1)
        reorder(nat, nat + 32, order, q + 32 * (b - 1));
      else if (b == nb - 1)
        reorder(nat, nullptr, order, q + 32 * b);
    }
  }
}

void quantize_tile(const float* x, int64_t K, int64_t t0, int64_t t_end, int lanes, ActTile& out) {
  const int64_t nb = K / 32;
  out.K = K;
  out.lanes = lanes;
  int8_t q[32];
  float d;
  int32_t s16[2];
  for (int t = 0; t < lanes; t++) {
    const bool real = t0 + t < t_end;
    const float* xr = x + (t0 + t) * K;
    for (int64_t b = 0; b < nb; b++) {
      if (real) {
        quantize_block(xr + 32 * b, q, &d, s16);
      } else {
        std::memset(q, 0, sizeof(q));
        d = 0.f;
        s16[0] = s16[1] = 0;
      }
      for (int c = 0; c < 8; c++) std::memcpy(out.q + ((8 * b + c) * lanes + t) * 4, q + 4 * c, 4);
      out.d[b * lanes + t] = d;
      out.s[b * lanes + t] = d * (float)(s16[0] + s16[1]);
      out.s16[(2 * b) * lanes + t] = s16[0];
      out.s16[(2 * b + 1) * lanes + t] = s16[1];
    }
  }
}

}  // namespace mf
