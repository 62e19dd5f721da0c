// GGUF's block quantizations, decoded one block at a time into float32 (the CPU block kernel's inner
// step, blockmatmul.cpp). Layouts as ggml stores them (little-endian; d, dmin, m: float16):
//
//   Q5_0  32 weights, 22 bytes: d, qh (32 high bits), qs[16]  w[j] = d * (q_j - 16), q_j 5 bits
//   Q5_1  32 weights, 24 bytes: d, m, qh, qs[16]              w[j] = d * q_j + m
//   Q4_K  256 weights, 144 bytes: d, dmin, scales[12] (eight 6-bit scale/min pairs), qs[128]
//         sub-block s of 32: w = d * sc_s * q - dmin * m_s, q 4 bits
//   Q5_K  256 weights, 176 bytes: d, dmin, scales[12], qh[32], qs[128]; as Q4_K with a fifth bit
//   Q6_K  256 weights, 210 bytes: ql[128], qh[64], scales[16] (int8), d
//         sub-block s of 16: w = d * sc_s * (q - 32), q 6 bits
//
// Every product here is exact in float32 (a float16 times a <= 8-bit integer, times a <= 6-bit
// code), so the one rounding is the final add of Q5_1's m or the K types' minimum: the values equal
// the gguf package's dequantization bit for bit (tests/kernels/test_blockmatmul.py), and the plain-ops
// reference is kernels/gguf_blocks_ref.py.
#pragma once

#include <cstdint>
#include <cstring>

#include "qmatmul.h"

namespace mf {

// GGML type numbers (ggml.h).
enum GgufType { Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int block_weights(int type) { return type == Q5_0 || type == Q5_1 ? 32 : 256; }
constexpr int block_bytes(int type) {
  return type == Q5_0 ? 22 : type == Q5_1 ? 24 : type == Q4_K ? 144 : type == Q5_K ? 176 : type == Q6_K ? 210 : 0;
}

#define MF_INLINE inline __attribute__((always_inline))

MF_INLINE float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

MF_INLINE uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
MF_INLINE void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <int TYPE>
MF_INLINE void decode_block(const uint8_t* b, float* y) {
  if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
    const float d = f16_at(b);
    const float m = TYPE == Q5_1 ? f16_at(b + 2) : 0.f;
    const uint8_t* after = b + (TYPE == Q5_1 ? 4 : 2);
    const uint32_t qh = u32_at(after);
    const uint8_t* qs = after + 4;
    for (int j = 0; j < 16; j++) {
      const int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
      const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      if constexpr (TYPE == Q5_0) {
        y[j] = d * (float)(lo - 16);
        y[j + 16] = d * (float)(hi - 16);
      } else {
        y[j] = d * (float)lo + m;
        y[j + 16] = d * (float)hi + m;
      }
    }
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;  // Q5_K only
    const uint8_t* qs = b + (TYPE == Q5_K ? 48 : 16);
    for (int c = 0; c < 4; c++) {  // 64 weights: sub-blocks 2c (low nibbles) and 2c + 1 (high)
      int sc0, m0, sc1, m1;
      scale_min_k4(2 * c, scales, &sc0, &m0);
      scale_min_k4(2 * c + 1, scales, &sc1, &m1);
      const float d0 = d * (float)sc0, mm0 = dmin * (float)m0, d1 = d * (float)sc1, mm1 = dmin * (float)m1;
      const uint8_t* q = qs + 32 * c;
      float* out = y + 64 * c;
      for (int l = 0; l < 32; l++) {
        int lo = q[l] & 0xF, hi = q[l] >> 4;
        if constexpr (TYPE == Q5_K) {
          lo |= ((qh[l] >> (2 * c)) & 1) << 4;
          hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
        }
        out[l] = d0 * (float)lo - mm0;
        out[l + 32] = d1 * (float)hi - mm1;
      }
    }
  } else if constexpr (TYPE == Q6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16_at(b + 208);
    for (int half = 0; half < 2; half++) {  // 128 weights each
      const uint8_t* l_ = ql + 64 * half;
      const uint8_t* h_ = qh + 32 * half;
      const int8_t* s = sc + 8 * half;
      float* out = y + 128 * half;
      for (int l = 0; l < 32; l++) {
        const int is = l / 16;
        const int q1 = ((l_[l] & 0xF) | (((h_[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((l_[l + 32] & 0xF) | (((h_[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4)) - 32;
        out[l] = (d * (float)s[is]) * (float)q1;
        out[l + 32] = (d * (float)s[is + 2]) * (float)q2;
        out[l + 64] = (d * (float)s[is + 4]) * (float)q3;
        out[l + 96] = (d * (float)s[is + 6]) * (float)q4;
      }
    }
  }
}

// y[T, N] = x[T, K] @ W^T for W in a GGUF block type, rows are outputs. Row n's block g lies at
//   w + (n / rpb) * wb + (n % rpb) * wr + g * wg   bytes
// (a plain [N, K / weights-per-block * bytes] matrix: rpb = N, wb = 0, wr = its row bytes, wg = the
// block bytes); row_ids / group_ids: a product over listed row blocks / blocks only (as Problem's).
struct BlockProblem {
  const float* x;
  const uint8_t* w;
  int type;
  int64_t T, K, N;
  float* y;
  int64_t rpb, wb, wr, wg;
  const int32_t* row_ids;
  const int32_t* group_ids;
  const float* xsum16;  // [T, K/16]: sum of x over each 16 inputs (the x86 paths' offsets)
};

// Each path computes outputs n0..n1; blockmatmul.cpp defines them (one per instruction set).
void block_rows_portable(const BlockProblem& p, int64_t n0, int64_t n1);
#if MF_X86
void block_rows_avx2(const BlockProblem& p, int64_t n0, int64_t n1);
void block_rows_avx512(const BlockProblem& p, int64_t n0, int64_t n1);
#endif

// The pool and the instruction set of qmatmul.cpp, shared by the block kernel: run fn(part) for
// part in 0..parts-1 (one product at a time), and the path chosen at load (0, 1, 2 as mf_cpu_isa).
void run_parts(int parts, void (*fn)(void*, int), void* arg);
int current_isa();

}  // namespace mf

extern "C" int mf_blockmatmul(const float* x, int64_t T, int64_t K, const uint8_t* w, int type, int64_t N, float* y,
                              int threads, const int64_t* layout, const int32_t* row_ids, const int32_t* group_ids,
                              int arith);
