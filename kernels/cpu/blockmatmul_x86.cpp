// AVX-512 and AVX2 loops of the CPU block kernel (blockmatmul.cpp). Compiled without -m flags: the
// functions carry target attributes and are called only on CPUs that report the instructions.
//
// Every block type is read as groups of 16 weights w = a * code + b (code 0..63, a and b floats of
// the group: Q5_0 a = d, b = -16 d; Q5_1 a = d, b = m; Q4_K / Q5_K a = d * sc, b = -dmin * m of the
// group's sub-block of 32; Q6_K a = d * sc, b = -32 a of its sub-block of 16), so a row's product is
//   sum over groups of  a * sum(code * x) + b * sum(x)
// with the codes widened to float and multiplied, never dequantized, and sum(x) per 16 inputs
// computed once per product (BlockProblem.xsum16). The codes come out of the packed bytes with SSE
// byte operations shared by both paths; the paths differ in vector width (16 or 8 floats).
#include "gguf_blocks.h"

#if MF_X86

namespace mf {

#define MF_SSE inline __attribute__((target("avx2,fma,f16c"), always_inline))

// Bytes 0x10 where bit j of the low 16 bits of `bits` is set (byte j), else 0: a fifth code bit.
MF_SSE __m128i fifth_bits(uint32_t bits) {
  const __m128i v = _mm_set1_epi16((short)(bits & 0xFFFF));
  const __m128i sel = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, (char)128, 1, 2, 4, 8, 16, 32, 64, (char)128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(sel, bit), bit), _mm_set1_epi8(0x10));
}

MF_SSE __m128i low4(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0F)); }
MF_SSE __m128i high4(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)); }
// Bits s and s+1 of each byte, as bits 4 and 5.
MF_SSE __m128i two_bits(__m128i v, int s) {
  return _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(v, s), _mm_set1_epi8(3)), 4);
}
MF_SSE __m128i one_bit(__m128i v, int s) {
  return _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(v, s), _mm_set1_epi8(1)), 4);
}
MF_SSE __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
// The low 8 codes as floats, less `shift`.
MF_SSE __m256 widen8(__m128i c, __m256i shift) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(c), shift));
}

MF_SSE float f16c_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The groups of 16 weights of block `blk` (see the top of the file): codes[g], a[g], b[g].
template <int TYPE>
MF_SSE void groups16(const uint8_t* blk, __m128i* codes, float* a, float* b) {
  auto f = [&](int g, __m128i c, float a_, float b_) {  // (inlined: no intrinsic inside)
    codes[g] = c;
    a[g] = a_;
    b[g] = b_;
  };
  if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
    const float d = f16c_at(blk);
    const float off = TYPE == Q5_1 ? f16c_at(blk + 2) : -16.f * d;
    const uint8_t* after = blk + (TYPE == Q5_1 ? 4 : 2);
    const uint32_t qh = u32_at(after);
    const __m128i qs = load16(after + 4);
    f(0, _mm_or_si128(low4(qs), fifth_bits(qh)), d, off);
    f(1, _mm_or_si128(high4(qs), fifth_bits(qh >> 16)), d, off);
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const float d = f16c_at(blk), dmin = f16c_at(blk + 2);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (TYPE == Q5_K ? 48 : 16);
    for (int c = 0; c < 4; c++) {
      int sc0, m0, sc1, m1;
      scale_min_k4(2 * c, blk + 4, &sc0, &m0);
      scale_min_k4(2 * c + 1, blk + 4, &sc1, &m1);
      const float a0 = d * (float)sc0, b0 = -(dmin * (float)m0), a1 = d * (float)sc1, b1 = -(dmin * (float)m1);
      for (int l = 0; l < 32; l += 16) {
        const __m128i q = load16(qs + 32 * c + l);
        __m128i lo = low4(q), hi = high4(q);
        if constexpr (TYPE == Q5_K) {
          const __m128i h = load16(qh + l);
          lo = _mm_or_si128(lo, one_bit(h, 2 * c));
          hi = _mm_or_si128(hi, one_bit(h, 2 * c + 1));
        }
        f(4 * c + l / 16, lo, a0, b0);
        f(4 * c + 2 + l / 16, hi, a1, b1);
      }
    }
  } else if constexpr (TYPE == Q6_K) {
    // group g's scale is sc[g] (the loop below names it 8h + is + 2r): all sixteen converted at once
    const __m128i sc16 = load16(blk + 192);
    const __m256 dv = _mm256_set1_ps(f16c_at(blk + 208)), m32 = _mm256_set1_ps(-32.f);
    const __m256 a0 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc16)));
    const __m256 a1 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8))));
    _mm256_storeu_ps(a, a0);
    _mm256_storeu_ps(a + 8, a1);
    _mm256_storeu_ps(b, _mm256_mul_ps(m32, a0));
    _mm256_storeu_ps(b + 8, _mm256_mul_ps(m32, a1));
    for (int h = 0; h < 2; h++) {
      const uint8_t* ql = blk + 64 * h;
      const uint8_t* qh = blk + 128 + 32 * h;
      for (int l = 0; l < 32; l += 16) {
        const int is = l / 16;
        const __m128i A = load16(ql + l), B = load16(ql + l + 32), H = load16(qh + l);
        const __m128i q[4] = {_mm_or_si128(low4(A), two_bits(H, 0)), _mm_or_si128(low4(B), two_bits(H, 2)),
                              _mm_or_si128(high4(A), two_bits(H, 4)), _mm_or_si128(high4(B), two_bits(H, 6))};
        for (int r = 0; r < 4; r++) codes[8 * h + 2 * r + is] = q[r];
      }
    }
  }
}

constexpr int TILE = 4;  // tokens per pass over a row's blocks

// ---- AVX-512 -------------------------------------------------------------------------------------
#define MF_512 inline __attribute__((target("avx512f,avx512bw,avx2,fma,f16c"), always_inline))

// One token (a decode step): the accumulators are named registers. The tiled loop below indexes
// them by a run-time token, which keeps them in memory: every block's FMA then waits on a store and
// a reload, about 7 cycles a block whatever the decoding costs.
template <int TYPE>
MF_512 void rows512_one(const BlockProblem& p, int64_t n0, int64_t n1) {
  constexpr int QK = block_weights(TYPE), G = QK / 16;
  constexpr bool PAIRED = TYPE != Q6_K;
  constexpr bool SIGNED = TYPE == Q5_0;
  const int64_t blocks = p.K / QK;
  const __m512i shift = _mm512_set1_epi32(SIGNED ? 16 : 0);
  for (int64_t n = n0; n < n1; n++) {
    const int64_t rb = p.row_ids ? p.row_ids[n / p.rpb] : n / p.rpb;
    const uint8_t* row = p.w + rb * p.wb + (n % p.rpb) * p.wr;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), offv = _mm512_setzero_ps();
    float off0 = 0.f, off1 = 0.f;
    for (int64_t g = 0; g < blocks; g++) {
      const int64_t gid = p.group_ids ? p.group_ids[g] : g;
      const float* x = p.x + g * QK;
      if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
        // one group of 32 with one scale: the fifth code bits go straight into lane masks (weight
        // j's is bit j of qh), one masked add (Q5_1: low4 + 16) or subtract (Q5_0: the code less
        // 16 where the bit is clear) per 16 weights instead of the byte shuffles of groups16
        const uint8_t* blk = row + gid * p.wg;
        constexpr int OFF = SIGNED ? 2 : 4;
        const uint32_t qh = u32_at(blk + OFF);
        const __m128i qs = load16(blk + OFF + 4);
        const __m512i sixteen = _mm512_set1_epi32(16);
        __m512i i0 = _mm512_cvtepu8_epi32(low4(qs)), i1 = _mm512_cvtepu8_epi32(high4(qs));
        if constexpr (SIGNED) {
          i0 = _mm512_mask_sub_epi32(i0, _cvtu32_mask16(~qh & 0xFFFF), i0, sixteen);
          i1 = _mm512_mask_sub_epi32(i1, _cvtu32_mask16(~qh >> 16), i1, sixteen);
        } else {
          i0 = _mm512_mask_add_epi32(i0, _cvtu32_mask16(qh & 0xFFFF), i0, sixteen);
          i1 = _mm512_mask_add_epi32(i1, _cvtu32_mask16(qh >> 16), i1, sixteen);
        }
        const __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_loadu_ps(x + 16),
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(i0), _mm512_loadu_ps(x)));
        if (g & 1)
          acc1 = _mm512_fmadd_ps(_mm512_set1_ps(f16c_at(blk)), s, acc1);
        else
          acc0 = _mm512_fmadd_ps(_mm512_set1_ps(f16c_at(blk)), s, acc0);
        if constexpr (!SIGNED) {  // the block's offset m times the sum of its 32 inputs
          const float m = f16c_at(blk + 2) * (p.xsum16[2 * g] + p.xsum16[2 * g + 1]);
          if (g & 1) off1 += m; else off0 += m;
        }
        continue;
      }
      if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
        // the eight 6-bit scales and minimums unpacked with word operations (ggml's layout: bytes
        // 0-3 scales 0-3 and 4-7 minimums 0-3 in their low six bits, their top two bits and bytes
        // 8-11 the rest), converted to floats eight at a time instead of one by one
        const uint8_t* blk = row + gid * p.wg;
        uint32_t u[4];
        std::memcpy(u, blk + 4, 12);
        constexpr uint32_t K1 = 0x3f3f3f3f, K2 = 0x0f0f0f0f, K3 = 0x03030303;
        u[3] = ((u[2] >> 4) & K2) | (((u[1] >> 6) & K3) << 4);
        const uint32_t mins_low = u[1] & K1;
        u[1] = (u[2] & K2) | (((u[0] >> 6) & K3) << 4);
        u[2] = mins_low;
        u[0] &= K1;
        const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(f16c_at(blk)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u)))));
        const __m256 mn = _mm256_mul_ps(_mm256_set1_ps(f16c_at(blk + 2)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 2)))));
        alignas(32) float a8[8];
        _mm256_store_ps(a8, sc);
        // the minimums: sub-block j's times the sum of its 32 inputs (two sums of 16), subtracted
        const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        offv = _mm512_fnmadd_ps(_mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(mn)),
                                _mm512_loadu_ps(p.xsum16 + g * G), offv);
        const uint8_t* qh = blk + 16;
        const uint8_t* qs = blk + (TYPE == Q5_K ? 48 : 16);
        for (int c = 0; c < 4; c++) {
          const __m128i q0 = load16(qs + 32 * c), q1 = load16(qs + 32 * c + 16);
          __m128i l0 = low4(q0), l1 = low4(q1), h0 = high4(q0), h1 = high4(q1);
          if constexpr (TYPE == Q5_K) {
            const __m128i b0 = load16(qh), b1 = load16(qh + 16);
            l0 = _mm_or_si128(l0, one_bit(b0, 2 * c));
            l1 = _mm_or_si128(l1, one_bit(b1, 2 * c));
            h0 = _mm_or_si128(h0, one_bit(b0, 2 * c + 1));
            h1 = _mm_or_si128(h1, one_bit(b1, 2 * c + 1));
          }
          const float* xc = x + 64 * c;
          const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(l1)), _mm512_loadu_ps(xc + 16),
                                            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(l0)), _mm512_loadu_ps(xc)));
          const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h1)), _mm512_loadu_ps(xc + 48),
                                            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h0)), _mm512_loadu_ps(xc + 32)));
          acc0 = _mm512_fmadd_ps(_mm512_set1_ps(a8[2 * c]), lo, acc0);
          acc1 = _mm512_fmadd_ps(_mm512_set1_ps(a8[2 * c + 1]), hi, acc1);
        }
        continue;
      }
      __m128i codes[G];
      float a[G], b[G];
      groups16<TYPE>(row + gid * p.wg, codes, a, b);
      for (int k = 0; k < G; k += 2) {
        const __m512 c0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes[k]), shift));
        const __m512 c1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes[k + 1]), shift));
        if constexpr (PAIRED) {
          const __m512 s = _mm512_fmadd_ps(c1, _mm512_loadu_ps(x + 16 * k + 16), _mm512_mul_ps(c0, _mm512_loadu_ps(x + 16 * k)));
          if ((k >> 1) & 1)
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(a[k]), s, acc1);
          else
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(a[k]), s, acc0);
        } else {
          acc0 = _mm512_fmadd_ps(_mm512_set1_ps(a[k]), _mm512_mul_ps(c0, _mm512_loadu_ps(x + 16 * k)), acc0);
          acc1 = _mm512_fmadd_ps(_mm512_set1_ps(a[k + 1]), _mm512_mul_ps(c1, _mm512_loadu_ps(x + 16 * k + 16)), acc1);
        }
      }
      const float* xs = p.xsum16 + g * G;
      if constexpr (G == 16) {
        offv = _mm512_fmadd_ps(_mm512_loadu_ps(b), _mm512_loadu_ps(xs), offv);
      } else if constexpr (!SIGNED) {
        off0 += b[0] * xs[0];
        off1 += b[1] * xs[1];
      }
    }
    p.y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), offv)) + (off0 + off1);
  }
}

template <int TYPE>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"), always_inline)) inline void rows512(const BlockProblem& p,
                                                                                             int64_t n0, int64_t n1) {
  if (p.T == 1) return rows512_one<TYPE>(p, n0, n1);
  constexpr int QK = block_weights(TYPE), G = QK / 16;
  constexpr bool PAIRED = TYPE != Q6_K;  // groups 2j and 2j + 1 share their scale (sub-blocks of 32)
  constexpr bool SIGNED = TYPE == Q5_0;  // w = d (q - 16): the 16 comes off the codes, not as an offset
  const int64_t blocks = p.K / QK, g16 = p.K / 16;
  for (int64_t t0 = 0; t0 < p.T; t0 += TILE) {
    const int tn = (int)(p.T - t0 < TILE ? p.T - t0 : TILE);
    for (int64_t n = n0; n < n1; n++) {
      const int64_t rb = p.row_ids ? p.row_ids[n / p.rpb] : n / p.rpb;
      const uint8_t* row = p.w + rb * p.wb + (n % p.rpb) * p.wr;
      // two accumulators per token (even and odd groups) and the offsets' sum as a vector: no long
      // dependency chain of FMAs per token
      __m512 acc[TILE][2], offv[TILE];
      float off[TILE][2] = {};
      for (int t = 0; t < TILE; t++) acc[t][0] = acc[t][1] = offv[t] = _mm512_setzero_ps();
      for (int64_t g = 0; g < blocks; g++) {
        const int64_t gid = p.group_ids ? p.group_ids[g] : g;
        __m128i codes[G];
        float a[G], b[G];
        groups16<TYPE>(row + gid * p.wg, codes, a, b);
        for (int k = 0; k < G; k += 2) {
          const __m512i shift = _mm512_set1_epi32(SIGNED ? 16 : 0);  // Q5_0: codes - 16, no offset term
          const __m512 c0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes[k]), shift));
          const __m512 c1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(codes[k + 1]), shift));
          const __m512 a0 = _mm512_set1_ps(a[k]), a1 = _mm512_set1_ps(a[k + 1]);
          const int64_t xi = g * QK + 16 * k;
          for (int t = 0; t < tn; t++) {
            const float* x = p.x + (t0 + t) * p.K + xi;
            if constexpr (PAIRED) {  // one scale for both groups: scale their sum once
              const __m512 s = _mm512_fmadd_ps(c1, _mm512_loadu_ps(x + 16), _mm512_mul_ps(c0, _mm512_loadu_ps(x)));
              acc[t][(k >> 1) & 1] = _mm512_fmadd_ps(a0, s, acc[t][(k >> 1) & 1]);
            } else {
              acc[t][0] = _mm512_fmadd_ps(a0, _mm512_mul_ps(c0, _mm512_loadu_ps(x)), acc[t][0]);
              acc[t][1] = _mm512_fmadd_ps(a1, _mm512_mul_ps(c1, _mm512_loadu_ps(x + 16)), acc[t][1]);
            }
          }
        }
        for (int t = 0; t < tn; t++) {
          const float* xs = p.xsum16 + (t0 + t) * g16 + g * G;
          if constexpr (G == 16) {
            offv[t] = _mm512_fmadd_ps(_mm512_loadu_ps(b), _mm512_loadu_ps(xs), offv[t]);
          } else {
            if constexpr (!SIGNED)  // two chains, not one: a block's offsets do not wait on the last block's
              for (int k = 0; k < G; k++) off[t][k & 1] += b[k] * xs[k];
          }
        }
      }
      for (int t = 0; t < tn; t++)
        p.y[(t0 + t) * p.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), offv[t])) + (off[t][0] + off[t][1]);
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void block_rows_avx512(const BlockProblem& p, int64_t n0,
                                                                                int64_t n1) {
  switch (p.type) {
    case Q5_0: return rows512<Q5_0>(p, n0, n1);
    case Q5_1: return rows512<Q5_1>(p, n0, n1);
    case Q4_K: return rows512<Q4_K>(p, n0, n1);
    case Q5_K: return rows512<Q5_K>(p, n0, n1);
    case Q6_K: return rows512<Q6_K>(p, n0, n1);
  }
}

// ---- AVX2 ----------------------------------------------------------------------------------------
template <int TYPE>
MF_SSE void rows256(const BlockProblem& p, int64_t n0, int64_t n1) {
  constexpr int QK = block_weights(TYPE), G = QK / 16;
  constexpr bool PAIRED = TYPE != Q6_K;  // groups 2j and 2j + 1 share their scale (sub-blocks of 32)
  constexpr bool SIGNED = TYPE == Q5_0;  // w = d (q - 16): the 16 comes off the codes, not as an offset
  const int64_t blocks = p.K / QK, g16 = p.K / 16;
  for (int64_t t0 = 0; t0 < p.T; t0 += TILE) {
    const int tn = (int)(p.T - t0 < TILE ? p.T - t0 : TILE);
    for (int64_t n = n0; n < n1; n++) {
      const int64_t rb = p.row_ids ? p.row_ids[n / p.rpb] : n / p.rpb;
      const uint8_t* row = p.w + rb * p.wb + (n % p.rpb) * p.wr;
      __m256 acc[TILE][2], offv[TILE];
      float off[TILE][2] = {};
      for (int t = 0; t < TILE; t++) acc[t][0] = acc[t][1] = offv[t] = _mm256_setzero_ps();
      for (int64_t g = 0; g < blocks; g++) {
        const int64_t gid = p.group_ids ? p.group_ids[g] : g;
        __m128i codes[G];
        float a[G], b[G];
        groups16<TYPE>(row + gid * p.wg, codes, a, b);
        for (int k = 0; k < G; k += 2) {
          const __m256i shift = _mm256_set1_epi32(SIGNED ? 16 : 0);  // Q5_0: codes - 16, no offset term
          const __m256 c0 = widen8(codes[k], shift), c1 = widen8(_mm_srli_si128(codes[k], 8), shift);
          const __m256 c2 = widen8(codes[k + 1], shift), c3 = widen8(_mm_srli_si128(codes[k + 1], 8), shift);
          const __m256 va = _mm256_set1_ps(a[k]), vb = _mm256_set1_ps(a[k + 1]);
          const int64_t xi = g * QK + 16 * k;
          for (int t = 0; t < tn; t++) {
            const float* x = p.x + (t0 + t) * p.K + xi;
            const __m256 s = _mm256_fmadd_ps(c1, _mm256_loadu_ps(x + 8), _mm256_mul_ps(c0, _mm256_loadu_ps(x)));
            const __m256 u = _mm256_fmadd_ps(c3, _mm256_loadu_ps(x + 24), _mm256_mul_ps(c2, _mm256_loadu_ps(x + 16)));
            if constexpr (PAIRED) {  // one scale for both groups: scale their sum once
              acc[t][(k >> 1) & 1] = _mm256_fmadd_ps(va, _mm256_add_ps(s, u), acc[t][(k >> 1) & 1]);
            } else {
              acc[t][0] = _mm256_fmadd_ps(va, s, acc[t][0]);
              acc[t][1] = _mm256_fmadd_ps(vb, u, acc[t][1]);
            }
          }
        }
        for (int t = 0; t < tn; t++) {
          const float* xs = p.xsum16 + (t0 + t) * g16 + g * G;
          if constexpr (G == 16) {
            offv[t] = _mm256_fmadd_ps(_mm256_loadu_ps(b), _mm256_loadu_ps(xs), offv[t]);
            offv[t] = _mm256_fmadd_ps(_mm256_loadu_ps(b + 8), _mm256_loadu_ps(xs + 8), offv[t]);
          } else {
            if constexpr (!SIGNED)  // two chains, not one: a block's offsets do not wait on the last block's
              for (int k = 0; k < G; k++) off[t][k & 1] += b[k] * xs[k];
          }
        }
      }
      for (int t = 0; t < tn; t++)
        p.y[(t0 + t) * p.N + n] = hsum_avx2(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), offv[t])) + (off[t][0] + off[t][1]);
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) void block_rows_avx2(const BlockProblem& p, int64_t n0, int64_t n1) {
  switch (p.type) {
    case Q5_0: return rows256<Q5_0>(p, n0, n1);
    case Q5_1: return rows256<Q5_1>(p, n0, n1);
    case Q4_K: return rows256<Q4_K>(p, n0, n1);
    case Q5_K: return rows256<Q5_K>(p, n0, n1);
    case Q6_K: return rows256<Q6_K>(p, n0, n1);
  }
}

}  // namespace mf

#endif  // MF_X86
