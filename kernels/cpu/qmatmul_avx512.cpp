// AVX-512 (F, BW) loops of the CPU kernel (16 lanes): the same structure as qmatmul_avx2.cpp.
// Compiled without -m flags (target attributes); qmatmul.cpp calls run_avx512 only on CPUs that
// report AVX-512 F and BW besides AVX2, FMA and F16C.
#include "qmatmul.h"

#if MF_X86
#include <vector>

namespace mf {

// ---- AVX-512 -------------------------------------------------------------------------------------
__attribute__((target("avx512f,avx512bw"))) inline __m512 codes16_avx512(const uint8_t* src, int bits) {
  // 16 consecutive codes as floats: 4-bit from two uint32 words, 8-bit from four.
  if (bits == 4) {
    uint64_t words;
    std::memcpy(&words, src, 8);
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    __m512i v = _mm512_permutexvar_epi32(pick, _mm512_set1_epi64((long long)words));
    v = _mm512_srlv_epi32(v, shifts);
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  }
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}

__attribute__((target("avx512f,avx512bw"))) void rows_avx512(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.K / p.group;
  const int step_bytes = 2 * p.bits;  // bytes holding 16 codes
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* row = row_codes(p, n);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      float bias_acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t g = 0; g < groups; g++) {
        __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        const uint8_t* src = group_codes(p, row, g);
        for (int j = 0; j < p.group; j += 16, src += step_bytes) {
          const __m512 c = codes16_avx512(src, p.bits);
          for (int t = 0; t < tn; t++)
            dot[t] = _mm512_fmadd_ps(c, _mm512_loadu_ps(p.x + (t0 + t) * p.K + g * p.group + j), dot[t]);
        }
        const int64_t so = scale_offset(p, n, g);
        const float s = scale_at(p.scales, p.scale_type, so), b = scale_at(p.biases, p.scale_type, so);
        const __m512 vs = _mm512_set1_ps(s);
        for (int t = 0; t < tn; t++) {
          acc[t] = _mm512_fmadd_ps(vs, dot[t], acc[t]);
          bias_acc[t] += b * p.xsum[(t0 + t) * groups + g];
        }
      }
      for (int t = 0; t < tn; t++) p.y[(t0 + t) * p.N + n] = _mm512_reduce_add_ps(acc[t]) + bias_acc[t];
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void rows4_avx512(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.K / p.group, blocks = p.group / 32;
  thread_local std::vector<float> sc, bi;
  sc.resize(groups);
  bi.resize(groups);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t n = n0; n < n1; n++) {
      row_scales(p, n, sc.data(), bi.data());
      const uint8_t* row = row_codes(p, n);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t g = 0; g < groups; g++) {
        __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        const uint8_t* src = group_codes(p, row, g);
        for (int64_t blk = 0; blk < blocks; blk++, src += 16) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
          const __m512 ev = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
          const __m512 od = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
          for (int t = 0; t < tn; t++) {
            const float* xp = p.xperm + (t0 + t) * p.K + (g * p.group + blk * 32);
            dot[t] = _mm512_fmadd_ps(ev, _mm512_loadu_ps(xp), dot[t]);
            dot[t] = _mm512_fmadd_ps(od, _mm512_loadu_ps(xp + 16), dot[t]);
          }
        }
        const __m512 vs = _mm512_set1_ps(sc[g]);
        for (int t = 0; t < tn; t++) acc[t] = _mm512_fmadd_ps(vs, dot[t], acc[t]);
      }
      for (int t = 0; t < tn; t++) {
        float bias = 0.f;
        const float* xs = p.xsum + (t0 + t) * groups;
        for (int64_t g = 0; g < groups; g++) bias += bi[g] * xs[g];
        p.y[(t0 + t) * p.N + n] = _mm512_reduce_add_ps(acc[t]) + bias;
      }
    }
  }
}

// 32 consecutive codes as floats in the order x is read: a 4-bit 32-block's 16 even then 16 odd
// codes (x as xperm), 8-bit codes in order.
template <int BITS>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void widen32_avx512(const uint8_t* src, __m512& c0,
                                                                                       __m512& c1) {
  if (BITS == 4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    c0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
    c1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
  } else {
    c0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    c1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
  }
}

// Decode (one token): RN rows at once share every load of x and give the CPU RN independent chains
// of multiply-adds (one row alone waits on its own accumulator once per group). 4-bit codes come as
// a 32-block's even then odd codes (x read as xperm), 8-bit ones in order (x as is).
template <int RN, int BITS>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void rows_matvec_avx512(const Problem& p, int64_t n,
                                                                                          float* const* sc,
                                                                                          float* const* bi) {
  const int64_t groups = p.K / p.group, blocks = p.group / 32;
  const float* x = BITS == 4 ? p.xperm : p.x;
  const uint8_t *row[RN], *src[RN];
  __m512 acc[RN];
  for (int r = 0; r < RN; r++) {
    row_scales(p, n + r, sc[r], bi[r]);
    row[r] = row_codes(p, n + r);
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; g++) {
    __m512 dot[RN];
    for (int r = 0; r < RN; r++) {
      dot[r] = _mm512_setzero_ps();
      src[r] = group_codes(p, row[r], g);
    }
    for (int64_t blk = 0; blk < blocks; blk++) {
      const float* xp = x + g * p.group + blk * 32;
      const __m512 x0 = _mm512_loadu_ps(xp), x1 = _mm512_loadu_ps(xp + 16);
      for (int r = 0; r < RN; r++) {
        __m512 c0, c1;
        widen32_avx512<BITS>(src[r], c0, c1);
        src[r] += BITS * 4;  // bytes of 32 codes
        dot[r] = _mm512_fmadd_ps(c0, x0, dot[r]);
        dot[r] = _mm512_fmadd_ps(c1, x1, dot[r]);
      }
    }
    for (int r = 0; r < RN; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r][g]), dot[r], acc[r]);
  }
  for (int r = 0; r < RN; r++) {
    float bias = 0.f;
    // fused explicitly: groups_decode adds the same terms in the same order and must round alike
    for (int64_t g = 0; g < groups; g++) bias = std::fma(bi[r][g], p.xsum[g], bias);
    p.y[n + r] = _mm512_reduce_add_ps(acc[r]) + bias;
  }
}

// The AVX-512 form of groups_decode_avx2 (rows side by side inside far-apart groups; see
// groups_apart): per row, the same operations in the same order as rows_matvec_avx512.
template <int BITS>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void groups_decode_avx512(const Problem& p, int64_t n0,
                                                                                      int64_t n1) {
  const int64_t groups = p.K / p.group, blocks = p.group / 32, rows = n1 - n0;
  const float* x = BITS == 4 ? p.xperm : p.x;
  thread_local std::vector<float> scratch;
  scratch.assign(rows * 17, 0.f);
  float *acc = scratch.data(), *bias = acc + rows * 16;  // [rows, 16] and [rows]
  for (int64_t g0 = 0; g0 < groups; g0 += GROUP_PASS) {
    const int64_t g1 = g0 + GROUP_PASS < groups ? g0 + GROUP_PASS : groups;
    for (int64_t n = n0; n < n1; n++) {
      __m512 a = _mm512_loadu_ps(acc + (n - n0) * 16);
      float b = bias[n - n0];
      const uint8_t* row = row_codes(p, n);
      for (int64_t g = g0; g < g1; g++) {
        const uint8_t* src = group_codes(p, row, g);
        __m512 dot = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < blocks; blk++, src += BITS * 4) {
          const float* xp = x + g * p.group + blk * 32;
          __m512 c0, c1;
          widen32_avx512<BITS>(src, c0, c1);
          dot = _mm512_fmadd_ps(c0, _mm512_loadu_ps(xp), dot);
          dot = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xp + 16), dot);
        }
        const int64_t so = scale_offset(p, n, g);  // the biases lie like the scales
        const float s = scale_f16c(static_cast<const char*>(p.scales) + so, p.scale_type, 0);
        a = _mm512_fmadd_ps(_mm512_set1_ps(s), dot, a);
        b = std::fma(scale_f16c(static_cast<const char*>(p.biases) + so, p.scale_type, 0), p.xsum[g], b);
      }
      _mm512_storeu_ps(acc + (n - n0) * 16, a);
      bias[n - n0] = b;
    }
  }
  for (int64_t n = n0; n < n1; n++) p.y[n] = _mm512_reduce_add_ps(_mm512_loadu_ps(acc + (n - n0) * 16)) + bias[n - n0];
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void rows_decode_avx512(const Problem& p, int64_t n0,
                                                                                    int64_t n1) {
  const int64_t groups = p.K / p.group;
  thread_local std::vector<float> scratch;
  scratch.resize(8 * groups);
  float* sc[4] = {scratch.data(), scratch.data() + groups, scratch.data() + 2 * groups, scratch.data() + 3 * groups};
  float* bi[4] = {sc[3] + groups, sc[3] + 2 * groups, sc[3] + 3 * groups, sc[3] + 4 * groups};
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows_matvec_avx512<4, BITS>(p, n, sc, bi);
  for (; n < n1; n++) rows_matvec_avx512<1, BITS>(p, n, sc, bi);
}

__attribute__((target("avx512f,avx512bw"))) void cols_avx512(const Problem& p, int64_t n0, int64_t n1) {
  // Tokens in tiles of 4, so that the tile's outputs stay in cache while every row of W passes.
  for (int64_t t = 0; t < p.T; t++) std::memset(p.y + t * p.N + n0, 0, (n1 - n0) * sizeof(float));
  for (int64_t t0 = 0; t0 < p.T; t0 += 4) {
    const int tn = (int)(p.T - t0 < 4 ? p.T - t0 : 4);
    for (int64_t k = 0; k < p.K; k++) {
      const uint8_t* row = input_row(p, k);
      __m512 xs[4], xb[4];
      for (int64_t g = n0 / p.group; g < n1 / p.group; g++) {
        const float s = scale_at(p.scales, p.scale_type, input_scale(p, k, g));
        const float b = scale_at(p.biases, p.scale_type, input_scale(p, k, g));
        for (int t = 0; t < tn; t++) {
          const float xv = p.x[(t0 + t) * p.K + k];
          xs[t] = _mm512_set1_ps(xv * s);
          xb[t] = _mm512_set1_ps(xv * b);
        }
        const uint8_t* src = group_codes(p, row, g);
        for (int j = 0; j < p.group; j += 16, src += 2 * p.bits) {
          const __m512 c = codes16_avx512(src, p.bits);
          for (int t = 0; t < tn; t++) {
            float* y = p.y + (t0 + t) * p.N + g * p.group + j;
            _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), _mm512_fmadd_ps(c, xs[t], xb[t])));
          }
        }
      }
    }
  }
}
// ---- AVX-512, many tokens (prefill): decode a tile of weights to float once, reuse it per token ----
// With T >= 4 the work per weight is T multiply-adds, so widening codes in the inner loop no longer
// pays; instead a few rows (or a 64-column block) are widened into a small per-thread float tile,
// in the order x is read (4-bit: each 32-block as its even then odd codes, matching xperm), and a
// 4-token x 4-row register block multiplies them. The tile is scratch the size of a few rows: no
// copy of the weight matrix exists.
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void widen_block_avx512(const uint8_t* src, int bits,
                                                                                    float s, float b, float* dst,
                                                                                    int64_t count) {
  // `count` codes (a multiple of 32) of one row, one group's scale and bias, into dst.
  const __m512 vs = _mm512_set1_ps(s), vb = _mm512_set1_ps(b);
  if (bits == 4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t j = 0; j < count; j += 32, src += 16, dst += 32) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m512 ev = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
      const __m512 od = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(ev, vs, vb));
      _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(od, vs, vb));
    }
    return;
  }
  for (int64_t j = 0; j < count; j += 16, src += 16, dst += 16) {
    const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(c, vs, vb));
  }
}

template <int TN, int RN>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void block_dots_avx512(
    const float* x, int64_t x_stride, const float* tile, int64_t K, float* y, int64_t y_stride) {
  // y[t * y_stride + r] = dot(x[t], tile[r]) for TN tokens and RN tile rows (each K floats).
  __m512 acc[TN][RN];
  for (int t = 0; t < TN; t++)
    for (int r = 0; r < RN; r++) acc[t][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[RN];
    for (int r = 0; r < RN; r++) w[r] = _mm512_loadu_ps(tile + r * K + k);
    for (int t = 0; t < TN; t++) {
      const __m512 xv = _mm512_loadu_ps(x + t * x_stride + k);
      for (int r = 0; r < RN; r++) acc[t][r] = _mm512_fmadd_ps(xv, w[r], acc[t][r]);
    }
  }
  for (int t = 0; t < TN; t++)
    for (int r = 0; r < RN; r++) y[t * y_stride + r] = _mm512_reduce_add_ps(acc[t][r]);
}

template <int RN>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void token_blocks_avx512(
    const Problem& p, const float* xs, const float* tile, int64_t n) {
  int64_t t = 0;
  for (; t + 4 <= p.T; t += 4) block_dots_avx512<4, RN>(xs + t * p.K, p.K, tile, p.K, p.y + t * p.N + n, p.N);
  for (; t < p.T; t++) block_dots_avx512<1, RN>(xs + t * p.K, p.K, tile, p.K, p.y + t * p.N + n, p.N);
}

__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void rows_tiled_avx512(const Problem& p, int64_t n0,
                                                                                   int64_t n1) {
  const int64_t groups = p.K / p.group;
  const float* xs = p.bits == 4 ? p.xperm : p.x;  // the order the tile is widened in
  thread_local std::vector<float> tile, sc, bi;
  tile.resize(4 * p.K);
  sc.resize(groups);
  bi.resize(groups);
  for (int64_t n = n0; n < n1; n += 4) {
    const int rn = (int)(n1 - n < 4 ? n1 - n : 4);
    for (int r = 0; r < rn; r++) {
      row_scales(p, n + r, sc.data(), bi.data());
      const uint8_t* row = row_codes(p, n + r);
      for (int64_t g = 0; g < groups; g++)
        widen_block_avx512(group_codes(p, row, g), p.bits, sc[g], bi[g], tile.data() + r * p.K + g * p.group,
                           p.group);
    }
    switch (rn) {
      case 4: token_blocks_avx512<4>(p, xs, tile.data(), n); break;
      case 3: token_blocks_avx512<3>(p, xs, tile.data(), n); break;
      case 2: token_blocks_avx512<2>(p, xs, tile.data(), n); break;
      default: token_blocks_avx512<1>(p, xs, tile.data(), n); break;
    }
  }
}

template <int TN>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void column_block_dots_avx512(
    const float* x, int64_t K, const float* tile, float* y, int64_t N, bool paired) {
  // y[t, 0:32] = x[t] @ tile (tile [K, 32]); `paired`: tile columns are a 32-block's even then odd codes.
  __m512 acc[TN][2];
  for (int t = 0; t < TN; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const __m512 w0 = _mm512_loadu_ps(tile + k * 32), w1 = _mm512_loadu_ps(tile + k * 32 + 16);
    for (int t = 0; t < TN; t++) {
      const __m512 xv = _mm512_set1_ps(x[t * K + k]);
      acc[t][0] = _mm512_fmadd_ps(xv, w0, acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(xv, w1, acc[t][1]);
    }
  }
  for (int t = 0; t < TN; t++) {
    if (!paired) {
      _mm512_storeu_ps(y + t * N, acc[t][0]);
      _mm512_storeu_ps(y + t * N + 16, acc[t][1]);
      continue;
    }
    alignas(64) float even[16], odd[16];
    _mm512_store_ps(even, acc[t][0]);
    _mm512_store_ps(odd, acc[t][1]);
    for (int i = 0; i < 16; i++) {
      y[t * N + 2 * i] = even[i];
      y[t * N + 2 * i + 1] = odd[i];
    }
  }
}

// Neuron-major weights (rows are inputs) with many tokens: widen one 32-column block of every row,
// then multiply it by up to 8 tokens at a time.
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void cols_tiled_avx512(const Problem& p, int64_t n0,
                                                                                   int64_t n1) {
  thread_local std::vector<float> tile;
  tile.resize(p.K * 32);
  for (int64_t c = n0; c < n1; c += 32) {
    const int64_t g = c / p.group;
    for (int64_t k = 0; k < p.K; k++)
      widen_block_avx512(input_row(p, k) + c * p.bits / 8, p.bits, scale_f16c(static_cast<const char*>(p.scales) + input_scale(p, k, g), p.scale_type, 0),
                         scale_f16c(static_cast<const char*>(p.biases) + input_scale(p, k, g), p.scale_type, 0), tile.data() + k * 32, 32);
    const bool paired = p.bits == 4;
    int64_t t = 0;
    for (; t + 8 <= p.T; t += 8)
      column_block_dots_avx512<8>(p.x + t * p.K, p.K, tile.data(), p.y + t * p.N + c, p.N, paired);
    for (; t + 4 <= p.T; t += 4)
      column_block_dots_avx512<4>(p.x + t * p.K, p.K, tile.data(), p.y + t * p.N + c, p.N, paired);
    for (; t < p.T; t++) column_block_dots_avx512<1>(p.x + t * p.K, p.K, tile.data(), p.y + t * p.N + c, p.N, paired);
  }
}
// Decode (one token), neuron-major weights: y[c] = sum_k (x_k s_kg) q_kc + sum_k x_k b_kg, so each
// code costs one multiply-add with a broadcast and each bias one scalar per row. NB 32-column blocks
// (up to 4: 128 bytes of an 8-bit row) go together, reading each row's codes as one run.
template <int BITS, int NB>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void cols_matvec_avx512(const Problem& p, int64_t c) {
  __m512 acc[NB][2];
  float bias[NB];
  int64_t g[NB];
  for (int j = 0; j < NB; j++) {
    acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    bias[j] = 0.f;
    g[j] = (c + 32 * j) / p.group;
  }
  for (int64_t k = 0; k < p.K; k++) {
    const uint8_t* src = input_row(p, k) + c * BITS / 8;
    const float xk = p.x[k];
    for (int j = 0; j < NB; j++) {
      const __m512 xs = _mm512_set1_ps(xk * scale_f16c(static_cast<const char*>(p.scales) + input_scale(p, k, g[j]), p.scale_type, 0));
      bias[j] += xk * scale_f16c(static_cast<const char*>(p.biases) + input_scale(p, k, g[j]), p.scale_type, 0);
      const uint8_t* b = src + j * BITS * 4;
      __m512 c0, c1;
      widen32_avx512<BITS>(b, c0, c1);
      acc[j][0] = _mm512_fmadd_ps(xs, c0, acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(xs, c1, acc[j][1]);
    }
  }
  for (int j = 0; j < NB; j++) {
    const __m512 vb = _mm512_set1_ps(bias[j]);
    float* y = p.y + c + 32 * j;
    if (BITS == 8) {
      _mm512_storeu_ps(y, _mm512_add_ps(acc[j][0], vb));
      _mm512_storeu_ps(y + 16, _mm512_add_ps(acc[j][1], vb));
    } else {  // even then odd codes: interleave back
      alignas(64) float even[16], odd[16];
      _mm512_store_ps(even, _mm512_add_ps(acc[j][0], vb));
      _mm512_store_ps(odd, _mm512_add_ps(acc[j][1], vb));
      for (int i = 0; i < 16; i++) {
        y[2 * i] = even[i];
        y[2 * i + 1] = odd[i];
      }
    }
  }
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void cols_decode_avx512(const Problem& p, int64_t n0,
                                                                                    int64_t n1) {
  int64_t c = n0;
  for (; c + 128 <= n1; c += 128) cols_matvec_avx512<BITS, 4>(p, c);
  for (; c < n1; c += 32) cols_matvec_avx512<BITS, 1>(p, c);
}

bool run_avx512(const Problem& p, int transposed, int64_t n0, int64_t n1) {
  if (p.bits == 2 || p.group % 16 != 0) return false;
  if (p.group % 32 == 0) {
    if (p.T >= 4) return transposed ? rows_tiled_avx512(p, n0, n1) : cols_tiled_avx512(p, n0, n1), true;
    if (p.T == 1) {
      if (transposed && groups_apart(p))
        return p.bits == 4 ? groups_decode_avx512<4>(p, n0, n1) : groups_decode_avx512<8>(p, n0, n1), true;
      if (transposed) return p.bits == 4 ? rows_decode_avx512<4>(p, n0, n1) : rows_decode_avx512<8>(p, n0, n1), true;
      return p.bits == 4 ? cols_decode_avx512<4>(p, n0, n1) : cols_decode_avx512<8>(p, n0, n1), true;
    }
    if (transposed && p.bits == 4) return rows4_avx512(p, n0, n1), true;
  }
  transposed ? rows_avx512(p, n0, n1) : cols_avx512(p, n0, n1);  // 16 codes at a time inside a group
  return true;
}

}  // namespace mf
#endif
